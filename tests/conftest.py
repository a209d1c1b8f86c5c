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

import pytest  # noqa: E402


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
