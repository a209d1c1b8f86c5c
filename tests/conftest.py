"""Shared fixtures. Nothing in the suite may reach a model or dataset hub: we force offline mode."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
# One OpenMP thread per test process (and the processes it starts), set before torch is imported: the suite's models
# are tiny, and on a small shared machine (CI's two cores, the ranks and workers tests start) a second thread
# spin-waits at every op: a few Trainer steps of tiny_llama took 36 s with two threads and 5 s with one. Whoever
# runs the tests with OMP_NUM_THREADS set keeps theirs.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The test processes xdist starts, and those the tests start, keep the memory they free (glibc's allocator: no mmap
# per big array, no trim of the heap). The tests allocate and free arrays of tens to hundreds of MB, and a fresh
# page costs a fault each time: packing 16 M Wikipedia lengths took 8.3 CPU-s in a plain process and 4.0 with these,
# and the suite about 27 user-s less in two runs back to back. Glibc reads them at process start, so they reach the
# processes started after this import, not this one; other C libraries ignore them.
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 32))
os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 32))

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


def pytest_configure(config):
    """In a process that collects the tests (a worker, or a plain run), the cyclic collector held off until the test
    modules are imported (``pytest_collection_finish``): its full passes over the growing module graph cost about
    1.5 CPU-s per process, and changed nothing.

    Before any worker starts (xdist's controller, or a plain run): the built-in corpus and tokenizer, if not
    cached yet, built once here. On an empty cache every worker and launched process that needed them first built
    its own copy at the same time (~5 s each, one kept); a warm cache costs one look at a file."""
    import gc

    collects = hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None)
    if collects:  # not xdist's controller, which collects nothing and keeps its collector running
        gc.disable()
    if hasattr(config, "workerinput") or config.getoption("collectonly"):
        return
    _write_bytecode_once()
    from lightning_seqmem.data.tokenizer import DEFAULT_VOCAB_SIZE, _default_path, load_tokenizer

    if not (_default_path(DEFAULT_VOCAB_SIZE) / "tokenizer.json").exists():
        load_tokenizer()


def _write_bytecode_once() -> None:
    """Where Python is told not to write bytecode (``PYTHONDONTWRITEBYTECODE``, set on this project's machines),
    every interpreter the suite starts (the two workers, and the console scripts, ranks, nodes and examples they
    run) compiled the package's and the tests' sources again: about 1.3 CPU-s for one that imports the training
    app. Compiled here once (under a second) into the ``__pycache__`` folders git ignores, as Python itself writes
    them without that setting, they are read instead. Files that cannot be written are left to compile as before."""
    if not sys.dont_write_bytecode:
        return  # each module is written at its first import, as usual
    import compileall

    root = Path(__file__).resolve().parents[1]
    for folder in ("lightning_seqmem", "tests", "benchmarks", "examples"):
        if (root / folder).is_dir():
            compileall.compile_dir(root / folder, quiet=2)


@pytest.fixture(scope="session")
def tokenizer():
    """The built-in BPE tokenizer (trained once on the built-in corpus, then cached)."""
    from lightning_seqmem.data.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def chat_tokenizer():
    """A fresh copy of the built-in tokenizer with the built-in chat template (ChatML layout, generation markers)."""
    from lightning_seqmem.data.chat_template import BUILTIN_CHAT_TEMPLATE
    from lightning_seqmem.data.tokenizer import load_tokenizer

    tok = load_tokenizer()
    tok.chat_template = BUILTIN_CHAT_TEMPLATE
    return tok


@pytest.fixture()
def small_text_dataset():
    """A small in-memory text dataset with one long document, for fast DataModule tests."""
    import datasets

    texts = [f"Document number {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 7) for i in range(40)]
    texts[3] = "A long document. " + "the quick brown fox jumps over the lazy dog " * 60
    return datasets.Dataset.from_dict({"text": texts})


def pytest_collection_finish(session):
    """Once every test module is imported (torch, transformers, Lightning: over half a million objects), move what is
    alive into the collector's permanent generation: each full collection then scans only what tests make. Garbage
    the tests make is collected as before; what is frozen stays (modules and their objects, alive all session
    anyway). Lightning's tuner collects several times per call, and a traced memory estimate makes enough objects to
    trigger full collections: those were 0.3 s each, and estimates a third slower."""
    import gc

    gc.collect()
    gc.freeze()
    gc.enable()  # paused since pytest_configure


_MODULE: list[str | None] = [None]  # the test module whose first test last froze the heap


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """At the first test of each module (the previous module's fixtures already finalized): collect, then freeze
    what is alive, as after collection. Tests import more as they go (PEFT, matplotlib, model classes, sympy) and
    fill session-wide caches, and every full pass walked all of it again: 124 passes, 22 CPU-s over the suite.
    Frozen at each module, a pass walks what the running module made: 3.4 CPU-s in all, with the collections
    added here. What is frozen and later becomes garbage in a cycle stays (session fixtures and caches, alive to
    the end anyway): the workers' peak RSS was 1.7 and 2.4 GB before, 2.3 and 1.2 GB after."""
    import gc

    module = item.module.__name__ if item.module else None
    if module != _MODULE[0]:
        _MODULE[0] = module
        gc.collect()
        gc.freeze()


# The suite's longest tests (fresh interpreters, simulated nodes, spawned ranks), longest first. Under ``-n 2`` a
# worker takes the next test when it is free: started first, the long ones run beside each other and the short
# ones fill in after, instead of one long test left alone at the end while the other worker idles.
START_FIRST = (
    "test_many_nodes_app",
    "test_examples",
    "test_ddp_data",
    "test_train",
    "test_cli",
    "test_read_matrix",
    "test_corpus",
    "test_install",
    "test_plan_app",
    "test_plan_search",
    "test_memory_estimate",
)


def pytest_collection_modifyitems(config, items):
    """Slow tests first, the modules of ``START_FIRST`` in its order; the order within a module is kept. With
    ``--dist loadgroup`` (pyproject's addopts) a worker takes one test at a time as it is free, so this order holds,
    and tests marked ``xdist_group`` (one expensive module fixture for them) run on one worker, the fixture made
    once. Only the expensive ones are marked: a group runs whole on one worker, ahead of the rest."""

    def key(item):
        module = item.module.__name__ if item.module else ""
        first = START_FIRST.index(module) if module in START_FIRST else len(START_FIRST)
        return (item.get_closest_marker("slow") is None, first)

    items.sort(key=key)
