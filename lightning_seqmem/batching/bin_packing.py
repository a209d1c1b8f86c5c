"""Bin packing on lengths: best-fit decreasing in bulk, then an exact repack of the rows it left with gaps.

Pure numpy/Python on ``[items]`` length arrays, no tokens. ``best_fit_decreasing`` is exact best-fit decreasing
over the whole dataset, done in bulk: documents of equal length are placed together and bins are bucketed by
remaining capacity, so the Python loop runs per (length, capacity) pair, not per document. ``pack_bins`` (the
``bfd`` packing) then repacks the rows best fit left with gaps, row pattern by row pattern over their length
histogram (``repack_partial_rows``, its search in ``exact_fit``), and keeps the result only when it needs fewer rows.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict

import numpy as np

from lightning_seqmem.batching.exact_fit import exact_fit_patterns

__all__ = ["best_fit_decreasing", "exact_fit_patterns", "pack_bins", "repack_partial_rows"]


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact best-fit decreasing bin packing of ``lengths`` (each in ``[1, capacity]``).

    Items are taken longest first; each goes into the open bin with the least room that still fits it.
    Equal items are placed in bulk: a bin with room ``c`` takes ``c // length`` of them in a row, because after
    each one it is still the tightest fit. Bins are bucketed by remaining room.

    Args:
        lengths: ``[items]`` positive ints.
        capacity: bin size.

    Returns:
        ``(order, bin_of)``: items in placement order (longest first) and the bin of each of them; bins are
        numbered in the order they were opened.
    """
    lengths = np.asarray(lengths)
    if lengths.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    # A narrow key lets numpy use radix sort: stable, linear, and far faster on millions of items. It is made
    # narrow first, then subtracted in place: no full-width temporary (fresh memory is what costs on big inputs).
    key = lengths.astype(np.uint16 if capacity < 2**16 else np.int64)
    np.subtract(capacity, key, out=key)
    order = np.argsort(key, kind="stable")
    histogram = np.bincount(key, minlength=capacity)  # by room left, so longest first
    values = np.flatnonzero(histogram)
    counts = histogram[values]
    values = capacity - values

    buckets: dict[int, list[int]] = defaultdict(list)  # open bins by remaining room
    rooms: list[int] = []  # sorted rooms that have open bins
    # Items longer than half a bin come first and each opens a bin of its own (every open bin has less room than
    # the item before it left, which is under half): placed in one numpy step, their bins numbered in order.
    big = int(np.searchsorted(-values, -(capacity // 2), side="left"))  # values descend: lengths > capacity // 2
    n_bins = int(counts[:big].sum())
    chunks: list = [range(n_bins)] if big else []  # bins that took items, one chunk per bulk placement
    per_bin_of: list[int] = [1] if big else []
    last_of: list[int] = [1] if big else []
    starts = np.cumsum(counts[:big]) - counts[:big]
    for length, start, count in zip(values[:big].tolist(), starts.tolist(), counts[:big].tolist()):
        if length < capacity:  # rooms ascend as lengths descend: insort appends
            rooms.append(capacity - length)
            buckets[capacity - length] = list(range(start, start + count))
    bisect_left, insort = bisect.bisect_left, bisect.insort
    for length, count in zip(values[big:].tolist(), counts[big:].tolist()):
        remaining = count
        while remaining:
            j = bisect_left(rooms, length)
            if j < len(rooms):  # the tightest open bin that fits
                room = rooms[j]
                bucket = buckets[room]
                per_bin = room // length
                k = -(-remaining // per_bin)
                if k >= len(bucket):  # takes the whole bucket
                    k, ids = len(bucket), bucket
                    buckets[room] = []
                    del rooms[j]
                else:
                    ids = bucket[-k:]
                    del bucket[-k:]
            else:  # nothing fits: open new bins
                room = capacity
                per_bin = room // length
                k = -(-remaining // per_bin)
                ids = range(n_bins, n_bins + k)
                n_bins += k
            chunks.append(ids)
            placed = k * per_bin if k * per_bin < remaining else remaining
            last = placed - (k - 1) * per_bin  # the last bin may take fewer
            per_bin_of.append(per_bin)
            last_of.append(last)
            full_room, last_room = room - per_bin * length, room - last * length
            if full_room == last_room:  # every bin of the chunk is left with the same room
                if full_room > 0:
                    if not buckets[full_room]:
                        insort(rooms, full_room)
                    buckets[full_room].extend(ids)
            else:
                if full_room > 0 and k > 1:
                    if not buckets[full_room]:
                        insort(rooms, full_room)
                    buckets[full_room].extend(ids[:-1])
                if last_room > 0:
                    if not buckets[last_room]:
                        insort(rooms, last_room)
                    buckets[last_room].append(ids[-1])
            remaining -= placed
    # Expand the chunks: every bin of a chunk took ``per_bin`` items, except its last bin, which took ``last``.
    sizes = np.fromiter(map(len, chunks), dtype=np.int64, count=len(chunks))
    ids = _flatten(chunks, int(sizes.sum()))
    takes = np.repeat(np.asarray(per_bin_of, dtype=np.int64), sizes)
    takes[np.cumsum(sizes) - 1] = last_of
    return order, np.repeat(ids, takes)


def _flatten(chunks: list, total: int) -> np.ndarray:
    """The bins of the chunks back to back. On millions of items, long ``range`` chunks (new bins opened in bulk)
    are filled by ``np.arange``, the rest item by item; on fewer, one pass item by item costs less than the loop
    over chunks (a window of distinct lengths makes one chunk per item)."""
    if total < 1 << 18:
        return np.fromiter(itertools.chain.from_iterable(chunks), dtype=np.int64, count=total)
    out = np.empty(total, dtype=np.int64)
    at, run = 0, []
    for chunk in chunks:
        if type(chunk) is range and len(chunk) >= 256:
            if run:
                flat = np.fromiter(itertools.chain.from_iterable(run), dtype=np.int64)
                out[at : at + flat.size] = flat
                at, run = at + flat.size, []
            out[at : at + len(chunk)] = np.arange(chunk.start, chunk.stop)
            at += len(chunk)
        else:
            run.append(chunk)
    if run:
        out[at:] = np.fromiter(itertools.chain.from_iterable(run), dtype=np.int64, count=total - at)
    return out


def repack_partial_rows(
    lengths: np.ndarray,
    order: np.ndarray,
    bin_of: np.ndarray,
    capacity: int,
    short: int = 0,
    max_work: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Improve a packing: dissolve its rows with a gap (and those holding a short item) and repack them exactly.

    Why: best-fit decreasing spends the short items on the first gaps it meets, so once they run out the last
    rows keep gaps no remaining item fits (Wikipedia @512: 0.99949 efficiency, ~284 k rows short by 1-17 tokens).
    ``exact_fit_patterns`` over the dissolved rows' histogram closes most of them (Wikipedia: 0.99969). Short items
    are the currency that closes gaps, so dissolving the full rows that hold one too gives it more to work with
    (then ``short=32``: 0.99983, 34 rows above the provable minimum for that histogram). Items it leaves
    unpacked go back through best fit. The repacked rows replace the dissolved ones only if there are fewer of
    them, so the result is never less efficient than the input; every other row stays as it was.

    Args:
        lengths: ``[items]`` lengths, each in ``[1, capacity]``.
        order, bin_of: a packing as ``best_fit_decreasing`` returns it.
        capacity: row size.
        short: full rows holding an item of at most this length are dissolved too.
        max_work: bound on ``exact_fit_patterns``'s search; default ``1000 + 8 x`` the rows dissolved, so
            it costs at most a few microseconds per dissolved row.

    Returns:
        ``(order, bin_of)`` in the same form: the rows kept first (numbered as before, gaps in the numbering
        closed), then the repacked rows; within a row, longest first.
    """
    if order.size == 0:
        return order, bin_of
    n_rows = int(bin_of.max()) + 1
    placed = lengths[order]
    if n_rows == -(-int(placed.sum()) // capacity):  # already the fewest rows the tokens fit in
        return order, bin_of
    dissolve = np.bincount(bin_of, weights=placed, minlength=n_rows) < capacity
    dissolve[bin_of[placed <= short]] = True
    in_pool = dissolve[bin_of]
    if not in_pool.any():
        return order, bin_of
    pool = order[in_pool]
    n_dissolved = int(dissolve.sum())
    if n_dissolved == -(-int(lengths[pool].sum()) // capacity):  # those rows are as few as their tokens allow
        return order, bin_of
    patterns, left = exact_fit_patterns(
        np.bincount(lengths[pool], minlength=capacity + 1),
        capacity,
        1000 + 8 * n_dissolved if max_work is None else max_work,
        row_limit=n_dissolved,
    )
    made = sum(times for _, times in patterns)
    if made + -(-int(left @ np.arange(capacity + 1)) // capacity) >= n_dissolved:  # cannot end with fewer rows
        return order, bin_of
    slot_len, slot_row = _pattern_slots(patterns)  # pattern k's row repeated ``times``, rows numbered from 0
    if left.any():  # what the bounded search did not reach: best fit, in rows after the patterns
        rest_len = np.repeat(np.arange(capacity + 1), left)
        rest_order, rest_bin = best_fit_decreasing(rest_len, capacity)
        base = int(slot_row[-1]) + 1 if slot_row.size else 0
        slot_len = np.concatenate([slot_len, rest_len[rest_order]])
        slot_row = np.concatenate([slot_row, rest_bin + base])
    new_rows = int(slot_row.max(initial=-1)) + 1
    if new_rows >= n_dissolved:
        return order, bin_of
    # Match items to slots of the same length: both sorted by length (stable), the i-th item takes the i-th slot.
    key = np.uint16 if capacity < 2**16 else np.int64
    new_order = np.empty(pool.size, dtype=np.int64)  # the item in each slot
    new_order[np.argsort((capacity - slot_len).astype(key), kind="stable")] = pool[
        np.argsort((capacity - lengths[pool]).astype(key), kind="stable")
    ]
    kept_rows = np.cumsum(~dissolve) - 1  # renumber the rows that stay
    n_kept = int(kept_rows[-1]) + 1
    stay = ~in_pool
    return (np.concatenate([order[stay], new_order]), np.concatenate([kept_rows[bin_of[stay]], slot_row + n_kept]))


def _pattern_slots(patterns: list[tuple[list[int], int]]) -> tuple[np.ndarray, np.ndarray]:
    """``(slot length, slot row)`` of the rows ``exact_fit_patterns`` describes: each pattern's row, ``times`` over."""
    sizes = np.fromiter((len(p) for p, _ in patterns), dtype=np.int64, count=len(patterns))
    times = np.fromiter((t for _, t in patterns), dtype=np.int64, count=len(patterns))
    flat = np.fromiter(itertools.chain.from_iterable(p for p, _ in patterns), dtype=np.int64, count=int(sizes.sum()))
    row_pattern = np.repeat(np.arange(len(patterns)), times)  # [rows]
    row_size = sizes[row_pattern]
    slot_row = np.repeat(np.arange(row_pattern.size), row_size)  # [slots]
    first_slot = np.cumsum(row_size) - row_size  # of each row
    pattern_start = np.cumsum(sizes) - sizes  # in ``flat``
    slot_len = flat[np.repeat(pattern_start[row_pattern] - first_slot, row_size) + np.arange(slot_row.size)]
    return slot_len, slot_row


def pack_bins(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``bfd`` packing: best-fit decreasing, then ``repack_partial_rows`` twice; same form as best fit returns.

    First only the rows with a gap are repacked (cheap: often enough to reach the fewest rows possible), then, if
    still above that, also the rows holding an item of at most ``capacity // 16`` tokens.
    """
    lengths = np.asarray(lengths)
    order, bin_of = best_fit_decreasing(lengths, capacity)
    short = capacity // 16
    repacked = repack_partial_rows(lengths, order, bin_of, capacity)
    if repacked[0] is order and not _full_row_holds(lengths, order, bin_of, capacity, short):
        return order, bin_of  # the second pass would dissolve the same rows and fail the same way
    return repack_partial_rows(lengths, *repacked, capacity, short)


def _full_row_holds(lengths: np.ndarray, order: np.ndarray, bin_of: np.ndarray, capacity: int, short: int) -> bool:
    """Whether a full row holds an item of at most ``short`` tokens (what ``repack_partial_rows(short=...)``
    dissolves besides the rows with a gap)."""
    placed = lengths[order]
    is_short = placed <= short
    if not is_short.any():
        return False
    full = np.bincount(bin_of, weights=placed) >= capacity
    return bool(full[bin_of[is_short]].any())
