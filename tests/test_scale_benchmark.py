"""Smoke test of benchmarks/scale.py's helpers: the synthetic corpus is deterministic, the tokenizer builds offline."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "scale.py"


@pytest.fixture(scope="module")
def scale():
    spec = importlib.util.spec_from_file_location("scale_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lengths_are_deterministic_heavy_tailed_and_bounded(scale):
    lengths = scale.document_lengths(50_000, seed=3)
    assert np.array_equal(lengths, scale.document_lengths(50_000, seed=3))
    assert not np.array_equal(lengths, scale.document_lengths(50_000, seed=4))
    assert lengths.min() >= 1 and lengths.max() <= 32768
    assert lengths.mean() > 1.5 * np.median(lengths)  # a long right tail pulls the mean above the median
    assert (lengths > 2048).any()  # some documents need splitting at max_length=2048


def test_corpus_is_deterministic_and_tokenizes_word_for_word(scale, tmp_path):
    import datasets

    first = scale.write_corpus(300, tmp_path / "a", seed=1, vocab_size=500, chunk_docs=128)
    again = scale.write_corpus(300, tmp_path / "b", seed=1, vocab_size=500, chunk_docs=128)
    assert (first / "corpus.arrow").read_bytes() == (again / "corpus.arrow").read_bytes()
    meta = json.loads((first / "meta.json").read_text())
    ds = datasets.Dataset.from_file(str(first / "corpus.arrow"))
    assert len(ds) == meta["documents"] == 300

    tok = scale.build_tokenizer(scale.word_vocabulary(500, seed=1))
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2) and len(tok) == 504
    ids = tok(ds["text"][:50], add_special_tokens=False)["input_ids"]
    assert [len(x) for x in ids] == [len(t.split()) for t in ds["text"][:50]]
    assert all(i >= 4 for x in ids for i in x)  # every word is in the vocabulary: no [UNK]
    assert sum(len(t.split()) for t in ds["text"]) == meta["words"]


def test_pretokenized_corpus_is_what_the_tokenizer_makes(scale, tmp_path):
    import datasets

    text = scale.write_corpus(200, tmp_path, seed=2, vocab_size=300, chunk_docs=64)
    tokens = scale.write_corpus(200, tmp_path, seed=2, vocab_size=300, chunk_docs=64, pretokenized=True)
    texts = datasets.Dataset.from_file(str(text / "corpus.arrow"))["text"]
    tok = scale.build_tokenizer(scale.word_vocabulary(300, seed=2))
    framed = [[tok.bos_token_id, *x, tok.eos_token_id] for x in tok(list(texts), add_special_tokens=False)["input_ids"]]
    assert datasets.Dataset.from_file(str(tokens / "corpus.arrow"))["input_ids"][:] == framed


def test_rss_growth_fits_a_slope_over_sizes(scale):
    gib = 2**30
    runs = [
        {"side": "ours", "run": "warm", "ok": True, "tokens": t, "peak_rss": gib + 10 * 2**20 * t / 1e6}
        for t in (60e6, 120e6)
    ]
    assert scale.rss_growth(runs)["warm"] == pytest.approx(10.0)
    assert scale.rss_growth(runs[:1]) is None  # one size: no slope
