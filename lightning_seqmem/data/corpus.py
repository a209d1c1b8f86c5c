"""Built-in corpus: real English-and-code text that ships with every Python install, no download.

Documents are the docstrings of the standard library (modules, classes, functions: mostly short) plus the full
source of one module in eight (long: thousands of tokens). That gives the heavy-tailed length distribution
of real pre-training data: many short documents and a tail far beyond a typical ``max_length``, which is what
makes padding, truncation and packing matter.

The build is deterministic for a given Python install (sorted files, fixed split rule) and cached on disk under
``$XDG_CACHE_HOME/lightning_seqmem`` (default ``~/.cache/lightning_seqmem``).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
import sysconfig
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_seqmem.data.cache_dir import build_folder, default_cache_dir

if TYPE_CHECKING:
    import datasets

CORPUS_VERSION = 1
CORPUS_PREFIX = "corpus-"  # the cache entry's name: <cache dir>/corpus-py<major><minor>-v<CORPUS_VERSION>
# Directories of the standard library that are not library text (tests, bundled wheels, demos, third party).
_SKIP_DIRS = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idlelib",
    "__pycache__",
    "ensurepip",
    "turtledemo",
    "lib2to3",
    "tkinter",
    "config-3",
    "pydoc_data",
}
_FULL_SOURCE_EVERY = 8  # one module in eight also contributes its whole source as one long document
_MAX_SOURCE_CHARS = 60_000  # keep the longest documents long, but bounded, so the corpus stays small
_VALIDATION_EVERY = 20  # about 5% of documents, chosen by content hash (stable under reordering)


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        # Pruned, not filtered afterwards: site-packages under the standard library can hold a whole ML stack.
        subfolders[:] = [name for name in subfolders if name not in _SKIP_DIRS and not name.startswith("config-")]
        files.extend(Path(folder, name) for name in names if name.endswith(".py"))
    return sorted(files)


_BLOCKS = (ast.stmt, ast.excepthandler, ast.match_case)  # the nodes that hold statements (and so definitions)


def _statements(tree: ast.Module) -> Iterator[ast.AST]:
    """``ast.walk``'s breadth-first order, restricted to statements and the blocks that hold them.

    A docstring belongs to a module, class or function definition, and a definition is a statement, never part of an
    expression: skipping expressions (most of a syntax tree) visits the same definitions in the same order, faster.
    """
    todo = deque([tree])
    while todo:
        node = todo.popleft()
        todo.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, _BLOCKS))
        yield node


def _documents_of(path: Path, full_source: bool) -> list[str]:
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    docs = []
    for node in _statements(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc.strip()) >= 20:
                docs.append(doc.strip())
    if full_source and len(source.strip()) > 0:
        docs.append(source[:_MAX_SOURCE_CHARS])
    return docs


def build_documents() -> list[str]:
    """All documents of the corpus, in a deterministic order. Pure function of the Python install."""
    docs: list[str] = []
    seen: set[str] = set()
    for i, path in enumerate(_stdlib_files()):
        for doc in _documents_of(path, full_source=(i % _FULL_SOURCE_EVERY == 0)):
            if doc not in seen:  # inherited docstrings repeat; keep the first
                seen.add(doc)
                docs.append(doc)
    if not docs:
        raise RuntimeError(
            f"Found no documents in the standard library at {sysconfig.get_paths()['stdlib']!r}; "
            "pass your own data with SeqMemDataModule(dataset=...) instead."
        )
    return docs


def _is_validation(doc: str) -> bool:
    return int(hashlib.sha1(doc.encode("utf-8")).hexdigest(), 16) % _VALIDATION_EVERY == 0


def corpus_fingerprint(docs: list[str]) -> str:
    """SHA-256 over every document, order included: equal fingerprints mean an identical corpus."""
    h = hashlib.sha256()
    for doc in docs:
        h.update(doc.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


def length_percentiles(lengths: list[int], qs=(50, 90, 99, 100)) -> dict[int, int]:
    """Nearest-rank percentiles of a list of lengths."""
    ordered = sorted(lengths)
    if not ordered:
        return {q: 0 for q in qs}
    return {q: ordered[min(len(ordered) - 1, max(0, -(-q * len(ordered) // 100) - 1))] for q in qs}


def corpus_path() -> Path:
    """The built-in corpus's cache entry for this Python (its standard library is the corpus)."""
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-v{CORPUS_VERSION}"
    return default_cache_dir() / f"{CORPUS_PREFIX}{tag}"


def load_builtin_corpus(verbose: bool = True) -> datasets.DatasetDict:
    """The built-in corpus as a ``DatasetDict`` with ``train``/``validation`` splits and a ``text`` column.

    Built on first use (a few seconds) and cached; later calls load it from disk.
    """
    import datasets

    path = corpus_path()
    if (path / "dataset_dict.json").exists():
        return datasets.load_from_disk(str(path))
    docs = build_documents()
    train = [d for d in docs if not _is_validation(d)]
    val = [d for d in docs if _is_validation(d)]
    dsd = datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"text": train}),
        validation=datasets.Dataset.from_dict({"text": val}),
    )
    # A folder of this writer's own, renamed into place whole: concurrent builders (ranks, nodes on a shared disk,
    # containers with one host name and process id) never see half a corpus nor write into each other's.
    with build_folder(path) as tmp:
        dsd.save_to_disk(str(tmp))
        fingerprint = corpus_fingerprint(docs)
        (tmp / "lightning_seqmem.json").write_text(json.dumps({"fingerprint": fingerprint, "documents": len(docs)}))
    if verbose:
        chars = [len(d) for d in docs]
        p = length_percentiles(chars)
        print(
            f"[lightning_seqmem] built-in corpus: {len(train):,} train + {len(val):,} validation documents, "
            f"{sum(chars) / 1e6:.1f} M characters; length in characters p50={p[50]:,} p90={p[90]:,} "
            f"p99={p[99]:,} max={p[100]:,} (cached at {path})"
        )
    return datasets.load_from_disk(str(path))
