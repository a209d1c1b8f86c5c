import json

import numpy as np

from lightning_seqmem.data.corpus import build_documents, corpus_fingerprint, length_percentiles, load_builtin_corpus


def test_build_is_deterministic():
    assert corpus_fingerprint(build_documents()) == corpus_fingerprint(build_documents())


def test_cached_corpus_has_splits_text_and_a_heavy_tail(tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    dsd = load_builtin_corpus()
    out = capsys.readouterr().out
    assert "built-in corpus" in out and "p50=" in out  # size and percentiles printed when built
    assert set(dsd) == {"train", "validation"} and dsd["train"].column_names == ["text"]
    assert len(dsd["validation"]) > 0 and len(dsd["train"]) > 10 * len(dsd["validation"])
    cached = tmp_path / "lightning_seqmem"
    [corpus_dir] = [p for p in cached.iterdir() if p.name.startswith("corpus-")]
    meta = json.loads((corpus_dir / "lightning_seqmem.json").read_text())
    assert meta["fingerprint"] == corpus_fingerprint(build_documents())

    # Loaded again from the cache: identical, and nothing printed.
    again = load_builtin_corpus()
    assert capsys.readouterr().out == ""
    assert list(again["train"]["text"]) == list(dsd["train"]["text"])

    lengths = np.array([len(ids) for ids in tokenizer(list(dsd["train"]["text"]))["input_ids"]])
    assert (lengths > 1024).sum() >= 10  # a tail far beyond a typical max_length
    assert np.median(lengths) < 100  # and many short documents
    assert lengths.max() > 20 * np.median(lengths)


def test_length_percentiles_nearest_rank():
    assert length_percentiles(list(range(1, 101)), qs=(50, 90, 100)) == {50: 50, 90: 90, 100: 100}
    assert length_percentiles([], qs=(50,)) == {50: 0}
