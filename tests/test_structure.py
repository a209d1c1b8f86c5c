"""The package's shape, as ARCHITECTURE.md draws it: imports point down the layers, never up, and never in a cycle.

Every import is read from the source (``ast``), including the ones inside functions that keep torch out of an
entry point's first import: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import lightning_seqmem

PACKAGE = Path(lightning_seqmem.__file__).parent

# Lower numbers are lower floors. A module may import its own folder and any folder on a lower floor.
LAYERS = {
    "": 0,  # the foundation at the top of the package: batch contract, protocols, messages, lazy exports
    "data": 1,
    "oom": 1.5,  # surviving an out-of-memory step by splitting the batch: under training/ and memory/
    "batching": 2,
    "training": 2,
    "mixing": 2.5,  # several sources mixed by weight: the spec, the interleaved order, its sampler (no Lightning)
    "kinds": 2.5,  # the data kinds: over data/ and batching/, under the DataModule and the apps
    "streams": 2.75,  # the stream engine: readers, rows, regrouping, counts, splits, identity, the mixed reader
    "datamodule": 3,
    "memory": 3,
    "warmup": 3,
    "apps": 4,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _folder(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 2 and (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return parts[1] if len(parts) > 2 else ""


def _imports() -> dict[str, set[str]]:
    """``module -> the lightning_seqmem modules it imports`` (``from pkg import name`` counts as ``pkg.name`` when that
    is a module, else as ``pkg``)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if "conf" in path.relative_to(PACKAGE).parts:
            continue
        module = _module_name(path)
        targets = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith("lightning_seqmem"))
            elif (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").startswith("lightning_seqmem")
            ):
                for alias in node.names:
                    candidate = f"{node.module}.{alias.name}"
                    is_module = (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(".py").exists() or (
                        PACKAGE.parent / candidate.replace(".", "/")
                    ).is_dir()
                    targets.add(candidate if is_module else node.module)
        targets.discard(module)
    return graph


def test_every_folder_is_on_a_floor():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders - {"conf"} <= set(LAYERS), (
        f"give {sorted(folders - set(LAYERS))} a floor in LAYERS and ARCHITECTURE.md"
    )


def test_imports_point_down_the_layers():
    up = []
    for module, targets in _imports().items():
        here = _folder(module)
        for target in targets:
            there = _folder(target)
            if target == "lightning_seqmem" or there == here:
                continue
            if LAYERS[there] >= LAYERS[here]:
                up.append(f"{module} -> {target}")
    assert not up, "imports that point up or sideways between folders:\n" + "\n".join(sorted(up))


def test_no_import_cycles():
    graph = _imports()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt in graph and not state.get(nxt):
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if not state.get(node):
            visit(node, [])
    # A package's __init__ that re-exports its own modules lazily is not a cycle: it imports nothing at import time.
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_module_hides_its_structure_in_length():
    long = {
        str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, f"modules over 400 lines (split them by concern): {long}"


# The flat layout's module paths (before the folders). They are gone, not forwarded: a 0.x package has no users'
# code to keep working, and a forwarding import finder ran on every import.
OLD_FLAT_MODULES = [
    "arrow_stream",
    "attention",
    "bin_packing",
    "cache",
    "cli",
    "collate",
    "console",
    "corpus",
    "data_source",
    "file_reads",
    "final_validation",
    "job_record",
    "loss",
    "metrics",
    "model",
    "packed_rows",
    "packing",
    "plan",
    "plan_app",
    "plan_cache",
    "plots",
    "progress",
    "report",
    "sampling",
    "streaming_packer",
    "strategies",
    "summary",
    "token_cache",
    "tokenizer",
    "tokens",
    "train",
    "truncation",
    "varlen",
]

# What a user's own training script imports from the top; everything else is imported from its folder.
TOP_LEVEL_EXPORTS = [
    "CachePreallocator",
    "CausalLM",
    "ConfigChecks",
    "DPO",
    "FinalValidation",
    "MemoryMonitor",
    "Mix",
    "Pack",
    "Pad",
    "SeqLengthWarmup",
    "SeqMemDataModule",
    "StepProgressBar",
    "TokenLossNormalizer",
    "Truncate",
    "configure_allocator",
    "flash_varlen_kwargs",
    "linear_cross_entropy",
    "load_tokenizer",
]


@pytest.mark.parametrize("old", OLD_FLAT_MODULES)
def test_old_flat_module_paths_do_not_import(old):
    assert not (PACKAGE / f"{old}.py").exists() and not (PACKAGE / old).is_dir()
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"lightning_seqmem.{old}")


def test_no_import_finder_is_installed():
    import sys

    ours = [f for f in sys.meta_path if type(f).__module__.startswith("lightning_seqmem")]
    assert not ours, f"import finders from the package: {ours}"


def test_top_level_exports_are_what_users_import():
    assert lightning_seqmem.__all__ == sorted(TOP_LEVEL_EXPORTS)
    assert set(TOP_LEVEL_EXPORTS) <= set(dir(lightning_seqmem))
    with pytest.raises(AttributeError, match="RunSummary"):
        lightning_seqmem.RunSummary  # noqa: B018  (app internals are imported from lightning_seqmem.apps)


def _packages() -> list[str]:
    return sorted(_module_name(p) for p in PACKAGE.rglob("__init__.py") if "conf" not in p.relative_to(PACKAGE).parts)


@pytest.mark.parametrize("package", _packages())
def test_every_package_export_resolves_to_its_home(package):
    """Each exported name is the object defined in the module its line names (no stale line, no chain of
    re-exports), under its own name (no alias); a package that imports its names eagerly defines them inside it."""
    module = importlib.import_module(package)
    exports = getattr(module, "_EXPORTS", {name: package for name in getattr(module, "__all__", [])})
    folder = PACKAGE.parent.joinpath(*package.split("."))
    for name, home in exports.items():
        # importing the submodule would set the package attribute of that name to the module, hiding the export
        assert not (folder / f"{name}.py").exists(), f"{package}.{name} is an export and a submodule"
        value = getattr(module, name)
        assert value is getattr(importlib.import_module(home), name)
        if callable(value) and hasattr(value, "__qualname__"):
            assert value.__qualname__ == name, f"{package}.{name} is {value.__qualname__} (an alias)"
            defined = value.__module__
            assert defined == home or (home == package and defined.startswith(f"{package}.")), (
                f"{package}.{name}: its line names {home}, it is defined in {defined}"
            )


def test_the_wheel_lists_every_folder():
    """setuptools ships the packages ``pyproject.toml`` names: a folder left out imports from a checkout only."""
    import tomllib

    listed = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert not set(_packages()) - set(listed), f"add {sorted(set(_packages()) - set(listed))} to pyproject.toml"


def _readme_imports() -> list[str]:
    """Every ``from lightning_seqmem... import ...`` statement in the Python blocks of the READMEs and docs."""
    statements = []
    docs = sorted((PACKAGE.parent / "docs").glob("*.md"))
    for readme in [PACKAGE.parent / "README.md", *PACKAGE.rglob("README.md"), *docs]:
        if not readme.exists():
            continue
        for block in readme.read_text().split("```python")[1:]:
            statements += [
                ast.unparse(node)
                for node in ast.walk(_parse_lenient(block.split("```")[0]))
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_seqmem")
            ]
    return statements


def _parse_lenient(code: str) -> ast.Module:
    """Parse a README block; blocks with placeholder lines are parsed statement by statement."""
    try:
        return ast.parse(code)
    except SyntaxError:
        body = []
        for chunk in code.split("\n\n"):
            try:
                body += ast.parse(chunk).body
            except SyntaxError:
                continue
        return ast.Module(body=body, type_ignores=[])


def test_readme_imports_resolve():
    statements = _readme_imports()
    assert statements, "the README shows no import of the package"
    for statement in statements:
        exec(statement, {})


@pytest.mark.parametrize("folder", ["batching", "kinds", "mixing", "streams"])
def test_the_functional_core_imports_no_lightning(folder):
    """The core folders run without Lightning: the stream engine and the mixers are tested and reused on their own."""
    found = []
    for path in (PACKAGE / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("lightning", "pytorch_lightning")]
    assert not found, f"{folder}/ imports Lightning: {found}"


def test_no_folder_is_deeper_than_six_floors():
    """The longest chain of imports inside one folder: a deeper one hides a concern that wants a folder of its own
    (the DataModule was eight deep while the stream engine lived in it)."""
    graph = _imports()
    depths: dict[str, int] = {}

    def depth(module: str) -> int:
        if module not in depths:
            depths[module] = 1  # a cycle would stop here (test_no_import_cycles names it)
            inside = [t for t in graph.get(module, ()) if t in graph and _folder(t) == _folder(module)]
            depths[module] = 1 + max((depth(t) for t in inside), default=0)
        return depths[module]

    deep = {m: depth(m) for m in graph if depth(m) > 6}
    assert not deep, f"import chains deeper than six modules inside a folder: {deep}"
