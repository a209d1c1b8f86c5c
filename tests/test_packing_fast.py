"""The bulk best fit and the repack's shortcuts give what the plain algorithms give; every input form packs alike."""

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_seqmem.batching import (
    best_fit_decreasing,
    exact_fit_patterns,
    pack_bins,
    pack_sequences,
    repack_partial_rows,
)
from lightning_seqmem.batching.bin_packing import _flatten
from lightning_seqmem.batching.exact_fit import _best_subset


def naive_best_fit_decreasing(lengths, capacity) -> list[int]:
    """One item at a time, longest first, into the open row with the least room that fits it: the rows' fills."""
    fills: list[int] = []
    for length in sorted(lengths, reverse=True):
        fitting = [r for r, fill in enumerate(fills) if capacity - fill >= length]
        if fitting:
            fills[min(fitting, key=lambda r: capacity - fills[r])] += length
        else:
            fills.append(length)
    return sorted(fills)


def _fills(lengths, order, bin_of, capacity) -> list[int]:
    """Rows' fills of a plan; checks every item is placed once and no row is over capacity or empty."""
    assert sorted(order.tolist()) == list(range(len(lengths)))
    fills = np.bincount(bin_of, weights=np.asarray(lengths, dtype=np.int64)[order]).astype(int) if len(order) else []
    assert all(0 < f <= capacity for f in fills)
    return sorted(int(f) for f in fills)


def plain_best_subset(room, counts, lengths) -> dict[int, int]:
    """The fill ``_best_subset`` promises, by sets of sums one copy at a time: the largest reachable sum, then from
    the longest length down the most copies that leave a sum reachable with the shorter lengths alone."""
    reachable = [{0}]  # reachable[i]: sums of the lengths before lengths[i]
    for a in lengths:
        sums = set(reachable[-1])
        for _ in range(counts[a]):
            sums |= {s + a for s in sums if s + a <= room}
        reachable.append(sums)
    s, out = max(reachable[-1]), {}
    for i in reversed(range(len(lengths))):
        a = lengths[i]
        j = min(counts[a], s // a)
        while s - j * a not in reachable[i]:
            j -= 1
        if j:
            out[a], s = j, s - j * a
    return out


# Rooms with few lengths (sums stay sparse: no early stop) and with many short ones (every sum reachable early).
subsets = st.integers(1, 200).flatmap(
    lambda room: st.tuples(
        st.just(room),
        st.dictionaries(st.integers(1, room), st.integers(1, 12), max_size=40),
    )
)


@settings(max_examples=300, deadline=None)
@given(subset=subsets)
def test_best_subset_is_the_plain_search(subset):
    """The search that stops once every longer sum is reachable fills a row as the plain search does."""
    room, have = subset
    counts = [have.get(a, 0) for a in range(room + 1)] + [1, 1]
    lengths = sorted(have)
    # As the repack calls it: its list of lengths left, longer ones after the first ``n``.
    assert _best_subset(room, counts, [*lengths, room + 1, room + 2], len(lengths)) == plain_best_subset(
        room, counts, lengths
    )


@settings(max_examples=25, deadline=None)
@given(
    chunks=st.lists(
        st.one_of(
            st.builds(lambda a, n: range(a, a + n), st.integers(0, 10**6), st.integers(1, 70_000)),
            st.lists(st.integers(0, 10**6), min_size=1, max_size=5),
        ),
        max_size=12,
    )
)
def test_best_fit_lays_out_its_bins_alike_on_millions_of_items(chunks):
    """The bins of best fit's chunks, as one array: long ranges by ``arange`` on big inputs, item by item below."""
    total = sum(map(len, chunks))
    expected = np.array([b for chunk in chunks for b in chunk], dtype=np.int64)
    assert np.array_equal(_flatten(chunks, total), expected)
    padded = [range(5, 5 + (1 << 18)), *chunks]  # over the size where the bulk path starts
    assert np.array_equal(_flatten(padded, total + (1 << 18)), np.concatenate([np.arange(5, 5 + (1 << 18)), expected]))


# Long items (over half a row: placed in bulk), short ones, and many repeats of a few lengths.
plans = st.integers(2, 120).flatmap(
    lambda cap: st.tuples(
        st.one_of(
            st.lists(st.integers(1, cap), max_size=120),
            st.lists(
                st.sampled_from(
                    sorted({x for x in (1, 2, 3, cap // 3 + 1, cap // 2, cap // 2 + 1, cap) if 1 <= x <= cap})
                ),
                max_size=120,
            ),
        ),
        st.just(cap),
    )
)


@settings(max_examples=200, deadline=None)
@given(plan=plans)
def test_bulk_best_fit_is_best_fit_decreasing(plan):
    """Same rows (fills) as placing one item at a time; ties between equal rooms cannot change the fills."""
    lengths, capacity = plan
    lengths = np.array(lengths, dtype=np.int64)
    order, bin_of = best_fit_decreasing(lengths, capacity)
    assert _fills(lengths, order, bin_of, capacity) == naive_best_fit_decreasing(lengths.tolist(), capacity)
    # Within a row, items are in placement order: longest first.
    placed = lengths[order]
    for row in range(int(bin_of.max(initial=-1)) + 1):
        in_row = placed[bin_of == row]
        assert np.all(np.diff(in_row) <= 0)


@settings(max_examples=150, deadline=None)
@given(plan=plans)
def test_pack_bins_is_both_repack_passes_and_never_below_best_fit(plan):
    """``pack_bins`` skips its second pass only where that pass would return its input: the result is the two
    passes run in full, and never has more rows than best fit alone (no token lost, no efficiency lost)."""
    lengths, capacity = plan
    lengths = np.array(lengths, dtype=np.int64)
    order, bin_of = best_fit_decreasing(lengths, capacity)
    both = repack_partial_rows(
        lengths, *repack_partial_rows(lengths, order, bin_of, capacity), capacity, capacity // 16
    )
    fast = pack_bins(lengths, capacity)
    assert all(np.array_equal(a, b) for a, b in zip(fast, both))
    assert len(_fills(lengths, *fast, capacity)) <= len(naive_best_fit_decreasing(lengths.tolist(), capacity))


@settings(max_examples=100, deadline=None)
@given(plan=plans, limit=st.integers(0, 60))
def test_row_limit_stops_only_where_the_rows_cannot_end_below_it(plan, limit):
    """With ``row_limit`` the patterns are the first ones made without it; where it stopped early, the rows made
    plus the fewest the rest needs reach the limit."""
    lengths, capacity = plan
    counts = np.bincount(np.array(lengths, dtype=np.int64), minlength=capacity + 1)
    full, _ = exact_fit_patterns(counts, capacity)
    cut, left = exact_fit_patterns(counts, capacity, row_limit=limit)
    assert full[: len(cut)] == cut
    if len(cut) < len(full):
        rows = sum(times for _, times in cut)
        assert rows + -(-int(left @ np.arange(capacity + 1)) // capacity) >= limit


def test_input_forms_pack_alike():
    """Dataset, Arrow list column, numpy ``(flat, offsets)`` and Python lists: the same rows, tokens and counts."""
    import datasets

    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 90, 300)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    flat = rng.integers(1, 1000, int(offsets[-1])).astype(np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat))
    forms = [
        datasets.Dataset(datasets.table.InMemoryTable(pa.table({"input_ids": column}))),
        column,
        (flat, offsets),
        [flat[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])],
    ]
    results = [pack_sequences(form, 64) for form in forms]
    tables = [r.as_table().to_pydict() for r in results]  # lists come in as int64, the rest as int32
    for res, table in zip(results[1:], tables[1:]):
        assert table == tables[0] and res.stats() == results[0].stats()
    assert results[0].real_tokens == lengths.sum() and results[0].documents_split == int((lengths > 64).sum())
