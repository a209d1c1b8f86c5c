"""The exact repack's row search: rows packed one pattern at a time from a length histogram, each filled as fully as
the items left allow by a bounded subset sum on a Python-int bitset.

``exact_fit_patterns`` is what ``bin_packing.repack_partial_rows`` runs on the rows best fit left with gaps; its
search (``_best_subset``) is most of the repack's time, so it lives here, apart from best fit.
"""

from __future__ import annotations

import bisect

import numpy as np

__all__ = ["exact_fit_patterns"]


def _best_subset(room: int, counts: list[int], lengths: list[int], n: int) -> dict[int, int]:
    """The multiset of ``lengths[:n]`` (at most ``counts[a]`` of each ``a``) with the largest sum ``<= room``.

    Bounded subset sum on a Python int used as a bitset (bit ``s`` set: sum ``s`` is reachable), one length at a
    time, shortest first, ``count`` copies added in binary chunks. Traced back from the longest length down, taking
    as many of each as still leaves a reachable rest, so the fill uses long items and saves short ones for later
    rows.

    Most rows close exactly with a long item and one or two short ones. A length over half the room fits once,
    and whether its rest (under half the room) is reachable depends only on the lengths up to that rest. So as
    the lengths are added, the long ones are asked in turn, longest first, each once every length up to its rest
    is in: the first whose rest is reachable is the one the traceback would take first, and the search ends there
    without adding the longer lengths. Otherwise it stops once every sum from the next length up to ``room`` is
    reachable (a longer length cannot add a sum then). Either way the fill is the plain search's.

    Args:
        room: the sum to reach.
        counts: available items of each length (indexed by length).
        lengths: ascending lengths with ``counts > 0``; the first ``n`` are ``<= room`` (the caller's list of
            lengths left, not copied per row).
        n: how many lengths to use.

    Returns:
        ``{length: how many}``.
    """
    mask = (1 << (room + 1)) - 1
    top = n - 1  # the next length over half the room to ask about, longest first (its rest: ``room - lengths[top]``)
    reach, before = 1, []  # ``before[i]``: the sums of ``lengths[:i]``
    for i in range(n):
        a = lengths[i]
        while top >= i and 2 * lengths[top] > room:
            rest = room - lengths[top]
            if counts[rest]:  # one item closes the row: the traceback takes it
                return {lengths[top]: 1, rest: 1}
            if rest >= a:  # not answered yet
                break
            if (reach >> rest) & 1:  # every length below ``a`` is in ``reach``; the longer ones cannot reach ``rest``
                return _trace_back(rest, counts, lengths, before) | {lengths[top]: 1}
            top -= 1
        # Every sum in [a, room] is reachable (so ``room`` is: the cheap test first): longer lengths add none.
        if reach.bit_length() > room and a >= (~reach & mask).bit_length():
            before += [reach] * (n - i)
            break
        before.append(reach)
        left = counts[a]
        if left == 1:
            reach = (reach | reach << a) & mask
            continue
        if left > room // a:
            left = room // a
        chunk = 1
        while left:  # unmasked within a length: the shifts add at most ``room`` bits
            take = chunk if chunk < left else left
            reach |= reach << (a * take)
            left -= take
            chunk <<= 1
        reach &= mask
    s = reach.bit_length() - 1
    while top >= 0 and 2 * lengths[top] > room:  # stopped early: the rests not yet asked about are reachable
        if (reach >> (room - lengths[top])) & 1:
            return _trace_back(room - lengths[top], counts, lengths, before[:top]) | {lengths[top]: 1}
        top -= 1
    return _trace_back(s, counts, lengths, before)


def _trace_back(s: int, counts: list[int], lengths: list[int], before: list[int]) -> dict[int, int]:
    """The fill of sum ``s`` from ``lengths[:len(before)]`` (``before[i]``: the sums ``lengths[:i]`` reach), longest
    first, as many of each as leave a reachable rest."""
    out = {}
    for i in range(len(before) - 1, -1, -1):
        a = lengths[i]
        if s < a:  # none fits: ``s`` was reachable without ``a``
            if not s:
                break
            continue
        j = counts[a]
        if j > s // a:
            j = s // a
        prev = before[i]
        while not (prev >> (s - j * a)) & 1:
            j -= 1
        if j:
            out[a] = j
            s -= j * a
    return out


def exact_fit_patterns(
    counts: np.ndarray, capacity: int, max_work: int = 10**5, row_limit: int | None = None
) -> tuple[list[tuple[list[int], int]], np.ndarray]:
    """Pack a length histogram row pattern by row pattern: each row is its longest item plus the fullest fill.

    The longest remaining length opens a row; ``_best_subset`` fills its room exactly when the remaining items
    allow (else as full as they allow). The same row is then repeated while the items last, so the loop runs once
    per distinct row pattern, not per row. Unlike best fit, each row is as full as the items still unpacked allow:
    it never leaves a gap that some combination of them could close.

    Args:
        counts: ``[capacity + 1]`` items of each length (lengths ``1..capacity``).
        capacity: row size.
        max_work: bound on the subset searches, in steps of one length tried for one row pattern (per 1024
            tokens of room; about a microsecond each): on a sparse histogram, or a huge ``capacity``, each
            pattern serves few rows and costs a long search, so the search stops there and returns the rest.
        row_limit: stop (returning the rest) once the rows made plus the fewest rows the rest needs reach this:
            a caller that keeps the result only when it has fewer rows would throw it away.

    Returns:
        ``(patterns, left)``: ``(row lengths, longest first; how many such rows)`` and the counts not packed.
    """
    counts = [int(c) for c in counts]
    available = [a for a in range(1, capacity + 1) if counts[a]]  # ascending
    patterns, work, rows = [], 0, 0
    tokens_left = sum(a * counts[a] for a in available)
    while available and work < max_work:
        if row_limit is not None and rows + -(-tokens_left // capacity) >= row_limit:
            break
        longest = available[-1]
        counts[longest] -= 1
        room = capacity - longest
        if room and counts[room]:  # one item closes the row: what the search would pick, without the search
            fill = {room: 1}
        else:
            fits = bisect.bisect_right(available, room)  # all with items left, but maybe ``longest``
            if fits and not counts[available[fits - 1]]:
                fits -= 1
            fill = _best_subset(room, counts, available, fits) if fits else {}
            work += fits * (room // 1024 + 1)
        counts[longest] += 1
        fill[longest] = fill.get(longest, 0) + 1
        times = min(counts[a] // n for a, n in fill.items())
        rows += times
        tokens_left -= times * sum(a * n for a, n in fill.items())
        for a, n in fill.items():
            counts[a] -= times * n
            if not counts[a]:
                del available[bisect.bisect_left(available, a)]
        patterns.append(([a for a in sorted(fill, reverse=True) for _ in range(fill[a])], times))
    return patterns, np.asarray(counts, dtype=np.int64)
