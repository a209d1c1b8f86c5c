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
    "batching": 2,
    "training": 2,
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


@pytest.mark.parametrize(
    "old, new",
    [
        ("lightning_seqmem.varlen", "lightning_seqmem.training.varlen"),
        ("lightning_seqmem.plan", "lightning_seqmem.apps.planner"),
        ("lightning_seqmem.packing", "lightning_seqmem.batching"),
        ("lightning_seqmem.model", "lightning_seqmem.training.model"),
    ],
)
def test_old_flat_paths_import_the_moved_module(old, new):
    """Users' code written against the flat layout keeps working: the old path is the same module object."""
    assert importlib.import_module(old) is importlib.import_module(new)


def test_readme_examples_import():
    from lightning_seqmem.model import build_model_config  # noqa: F401
    from lightning_seqmem.packing import pack_sequences
    from lightning_seqmem.plan import format_plan, plan  # noqa: F401
    from lightning_seqmem.varlen import flash_varlen_kwargs  # noqa: F401

    assert pack_sequences is lightning_seqmem.pack_sequences
