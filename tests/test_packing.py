"""Packing: token conservation (property-based), exact best-fit decreasing, overflow modes, errors, speed."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_seqmem.batching import (
    StreamingPacker,
    best_fit_decreasing,
    exact_fit_patterns,
    pack_bins,
    pack_lengths,
    pack_sequences,
    repack_partial_rows,
)

docs_strategy = st.lists(st.lists(st.integers(1, 999), min_size=0, max_size=40), min_size=0, max_size=30)


def _check_conservation(docs, res, max_length, eos=None):
    """Every kept token appears once, in order within its document; the rest is counted as cut or dropped."""
    assert all(len(r) <= max_length for r in res.rows)
    assert [sum(s) for s in res.seq_lengths] == [len(r) for r in res.rows]
    source = [d + [eos] if eos is not None and d else d for d in docs]
    covered = {i: np.zeros(len(d), dtype=int) for i, d in enumerate(source)}
    flat = res.input_ids.tolist()
    pos = 0
    for doc, start, n in zip(res.segment_doc, res.segment_start, res.segment_length):
        assert flat[pos : pos + n] == source[doc][start : start + n]
        covered[doc][start : start + n] += 1
        pos += n
    assert pos == len(flat)
    for _i, c in covered.items():
        assert c.max(initial=0) <= 1
        kept = int(c.sum())
        assert np.all(c[:kept] == 1)  # what is kept is a prefix (truncate) or everything (split)
    lost = sum(len(d) for d in source) - sum(int(c.sum()) for c in covered.values())
    assert lost == res.tokens_truncated + res.tokens_dropped
    assert res.empty_documents == sum(1 for d in docs if not d)
    assert res.documents == sum(1 for d in docs if d)


@settings(max_examples=60, deadline=None)
@given(docs=docs_strategy, max_length=st.integers(2, 50), overflow=st.sampled_from(["split", "truncate", "drop"]))
def test_bfd_conserves_tokens(docs, max_length, overflow):
    res = pack_sequences(docs, max_length, "bfd", overflow)
    _check_conservation(docs, res, max_length)
    if overflow == "split":
        assert res.tokens_truncated == res.tokens_dropped == 0
        assert res.documents_split == sum(1 for d in docs if len(d) > max_length)
    else:  # documents are never split: one segment each
        assert len(set(res.segment_doc.tolist())) == len(res.segment_doc)


@settings(max_examples=40, deadline=None)
@given(docs=docs_strategy, max_length=st.integers(2, 50), eos=st.sampled_from([None, 0]))
def test_wrapped_conserves_tokens_and_fills_rows(docs, max_length, eos):
    res = pack_sequences(docs, max_length, "wrapped", eos_token_id=eos)
    _check_conservation(docs, res, max_length, eos)
    assert all(len(r) == max_length for r in res.rows[:-1])  # only the last row may be short


def _reference_bfd(lengths, capacity):
    """Textbook best-fit decreasing, one item at a time: the bin fill levels it ends with."""
    bins = []
    for n in sorted(lengths, reverse=True):
        fits = [i for i, b in enumerate(bins) if b + n <= capacity]
        if fits:
            best = max(fits, key=lambda i: bins[i])
            bins[best] += n
        else:
            bins.append(n)
    return sorted(bins)


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(1, 64), max_size=120), capacity=st.integers(64, 100))
def test_bulk_bfd_equals_textbook_bfd(lengths, capacity):
    order, bin_of = best_fit_decreasing(np.array(lengths, dtype=np.int64), capacity)
    fill = np.bincount(bin_of, weights=np.array(lengths)[order], minlength=bin_of.max() + 1 if lengths else 0)
    assert sorted(fill.astype(int).tolist()) == _reference_bfd(lengths, capacity)
    assert np.all(np.diff(np.array(lengths)[order]) <= 0)  # longest first


def test_hand_worked_example():
    res = pack_sequences([[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], []], max_length=4)
    assert res.rows == [[7, 8, 9, 10], [1, 2, 3, 6], [4, 5]]
    assert res.seq_lengths == [[4], [3, 1], [2]]
    assert res.empty_documents == 1 and res.efficiency == 10 / 12


def test_overflow_modes_on_a_long_document():
    docs = [list(range(1, 11)), [20, 21]]
    split = pack_sequences(docs, 4, overflow="split")
    assert sorted(split.seq_lengths) == [[2, 2], [4], [4]] and split.documents_split == 1
    trunc = pack_sequences(docs, 4, overflow="truncate")
    assert trunc.tokens_truncated == 6 and [1, 2, 3, 4] in trunc.rows
    drop = pack_sequences(docs, 4, overflow="drop")
    assert drop.tokens_dropped == 10 and drop.rows == [[20, 21]]


def test_flat_array_input_matches_lists():
    docs = [[1, 2, 3], [4], [5, 6]]
    flat, offsets = np.array([1, 2, 3, 4, 5, 6]), np.array([0, 3, 4, 6])
    assert pack_sequences((flat, offsets), 4).rows == pack_sequences(docs, 4).rows


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(packing="greedy"), r"packing='greedy' is not valid; use one of \('bfd', 'wrapped'\)"),
        (dict(overflow="wrap"), r"overflow='wrap' is not valid; use one of \('split', 'truncate', 'drop', 'error'\)"),
        (dict(max_length=1), "max_length=1 is too small: set max_length to an integer >= 2"),
        (dict(overflow="error"), "document at row 1 has 9 tokens > max_length=4"),
    ],
)
def test_bad_input(kwargs, match):
    args = dict(max_length=4) | kwargs
    with pytest.raises(ValueError, match=match):
        pack_sequences([[1, 2], list(range(9))], **args)


def test_two_million_lengths_pack_whole_and_tight():
    """Two million documents: every token placed, rows nearly full. How fast is a benchmark's question, not a
    test's (a timed test fails on a loaded machine): ``python benchmarks/packing.py`` times 10 M, and
    ``--floor`` against one copy of the tokens."""
    lengths = np.minimum(np.random.default_rng(0).lognormal(5, 1.2, 2_000_000).astype(np.int64) + 1, 4096)
    res = pack_lengths(lengths, 512)
    assert res.real_tokens == lengths.sum() and res.efficiency > 0.999


@settings(max_examples=30, deadline=None)
@given(docs=docs_strategy, max_length=st.integers(2, 30), buffer_size=st.integers(1, 8))
def test_streaming_packer_conserves_tokens(docs, max_length, buffer_size):
    rows = list(StreamingPacker(max_length, buffer_size=buffer_size)(iter(docs)))
    pieces = []
    for row in rows:
        assert len(row["input_ids"]) <= max_length and sum(row["seq_lengths"]) == len(row["input_ids"])
        cuts = np.cumsum([0] + row["seq_lengths"])
        pieces.extend(tuple(row["input_ids"][a:b]) for a, b in zip(cuts[:-1], cuts[1:]))
    expected = [tuple(d[i : i + max_length]) for d in docs for i in range(0, len(d), max_length)]
    assert sorted(pieces) == sorted(expected)


def _check_bins(lengths, order, bin_of, capacity):
    """Every item in exactly one row, rows numbered 0..n-1, none over capacity; returns the row count."""
    assert sorted(order.tolist()) == list(range(len(lengths)))
    if not len(lengths):
        return 0
    fill = np.bincount(bin_of, weights=np.asarray(lengths)[order])
    assert fill.max() <= capacity and fill.min() > 0  # no empty row numbers
    return len(fill)


# Few distinct lengths, many copies: the regime where rows repeat and gaps accumulate (like real histograms).
lengths_strategy = st.one_of(
    st.lists(st.integers(1, 64), max_size=150),
    st.lists(st.sampled_from([1, 2, 3, 5, 8, 13, 21, 34, 55]), max_size=150),
)


@settings(max_examples=150, deadline=None)
@given(
    lengths=lengths_strategy,
    capacity=st.integers(64, 100),
    short=st.sampled_from([0, 4, 16]),
    max_work=st.sampled_from([1, 200, None]),
)
def test_repacking_never_loses_to_bfd_and_conserves_items(lengths, capacity, short, max_work):
    lengths = np.array(lengths, dtype=np.int64)
    order, bin_of = best_fit_decreasing(lengths, capacity)
    bfd_rows = _check_bins(lengths, order, bin_of, capacity)
    better = repack_partial_rows(lengths, order, bin_of, capacity, short, max_work)
    assert _check_bins(lengths, *better, capacity) <= bfd_rows
    assert _check_bins(lengths, *pack_bins(lengths, capacity), capacity) <= bfd_rows


@settings(max_examples=100, deadline=None)
@given(lengths=lengths_strategy, capacity=st.integers(64, 80), max_work=st.integers(1, 500))
def test_exact_fit_patterns_account_for_every_item(lengths, capacity, max_work):
    counts = np.bincount(np.array(lengths, dtype=np.int64), minlength=capacity + 1)
    patterns, left = exact_fit_patterns(counts, capacity, max_work=max_work)
    used = np.zeros_like(counts)
    for row, times in patterns:
        assert sum(row) <= capacity and times >= 1 and row == sorted(row, reverse=True)
        np.add.at(used, row, times)
    assert np.array_equal(used + left, counts) and left.min(initial=0) >= 0


def test_repacking_closes_gaps_best_fit_leaves():
    """BFD: [8] [5 3] [3 3 2] [2] (4 rows). Exact fill: [8] [5 2 2] [3 3 3] (3 rows, the minimum)."""
    lengths = [8, 5, 3, 3, 3, 2, 2]
    order, bin_of = best_fit_decreasing(np.array(lengths), 9)
    assert bin_of.max() + 1 == 4
    res = pack_sequences([[i] * n for i, n in enumerate(lengths)], 9)
    assert sorted(map(sorted, res.seq_lengths)) == [[2, 2, 5], [3, 3, 3], [8]]
    assert res.efficiency == 26 / 27
    assert res.rows == [res.row(r)["input_ids"] for r in range(res.num_rows)]


HISTOGRAMS = Path(__file__).resolve().parents[2] / "shared" / "data" / "length-histograms"


@pytest.mark.parametrize(
    "name, max_length, target", [("squad-1.1-384.tsv", 384, 0.977), ("wikipedia-512.tsv", 512, 0.9995)]
)
def test_published_histograms_reach_the_issue_targets(name, max_length, target):
    """Issue 3's efficiency targets on the published histograms (16.3 M Wikipedia lengths: 1-3 s)."""
    if not (HISTOGRAMS / name).exists():
        pytest.skip(f"{HISTOGRAMS / name} not found")
    table = np.loadtxt(HISTOGRAMS / name, dtype=np.int64, delimiter="\t", skiprows=1, ndmin=2)
    lengths = np.repeat(table[:, 0], table[:, 1])
    res = pack_lengths(lengths, max_length)
    assert res.efficiency >= target and res.real_tokens == lengths.sum()
    assert np.add.reduceat(res.segment_length, res.seg_row_offsets[:-1]).max() <= max_length
