"""The mixed order: whole rows of several sources interleaved so that every prefix holds each source's share.

Each source is packed (or padded, or truncated) on its own first; what is decided here is only which source gives
the next row. The rule is worst-case fair queueing (WF2Q, Bennett and Zhang 1996) with every source always
backlogged: a source is *eligible* when it is not ahead of its share (``w_s * T - t_s >= 0``, ``T`` the total put
into rows so far, ``t_s`` its part), and among the eligible the one whose next row, of ``r_s``, would be finished
first by an ideal fluid mix (the smallest ``(t_s + r_s) / w_s``) goes next; ties go to the earlier source.

The bound it proves, for every prefix of the order and every source ``s`` (rows of at most ``R`` counted units:
``max_length`` tokens with ``by="tokens"``)::

    -(1 - w_s) * R  <=  w_s * T - t_s  <=  R

Ahead by less than one row: a source is picked only when not ahead, and one row moves it at most ``(1 - w_s) r_s``
past its share. Behind by at most one row: WF2Q's lag bound against the fluid schedule, whose service of ``s`` after
``T`` units is exactly ``w_s * T`` here (every source always has a next row). Whole rows are the unit, so packing
keeps its efficiency and the share is never moved after the decision.

Pure numpy, no torch: the order depends only on the row sizes, the weights and the seed, so every rank can compute
every rank's order, and the state (``Interleaver.state_dict``) is a few integers per source.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

PassOrder = Callable[[int, int], np.ndarray]  # (source, pass) -> the source's row indices for that pass, in order


def pass_order(seed: int, epoch: int, rows: Sequence[int], rank: int = 0, world: int = 1) -> PassOrder:
    """Each source's rows for pass ``p``: a fresh permutation from ``(seed, epoch, source, p)`` over all of its rows,
    of which this rank takes every ``world``-th (``rank::world``), so the ranks read each row at most once per pass.
    A source with fewer rows than ranks gives the ranks it cannot reach none."""

    def order(source: int, p: int) -> np.ndarray:
        rng = np.random.default_rng([seed, epoch, source, p])
        return rng.permutation(int(rows[source]))[rank::world]

    return order


def choose(weights: Sequence[float], served: Sequence[int], total: int, next_sizes: Sequence[int]) -> int:
    """The source of the next row: among the sources not ahead of their share (``w_s * total - served_s >= 0``,
    with a rounding margin) the one whose next row would finish first in the fluid mix (the smallest
    ``(served_s + next_s) / w_s``); ties to the earlier source; sources of weight 0 never. Plain Python: a step of
    the order costs a few microseconds."""
    best, best_finish, margin = -1, math.inf, 1e-9 * max(1, total)
    for s, w in enumerate(weights):
        if w > 0 and w * total - served[s] >= -margin:
            finish = (served[s] + next_sizes[s]) / w
            if finish < best_finish:
                best, best_finish = s, finish
    return best


class Interleaver:
    """Which source gives each next row (module docstring: the rule and its bound).

    Args:
        weights: ``[sources]`` shares summing to 1 (a source of weight 0 is never read).
        sizes: per source, ``[rows]`` counted units of each row (tokens, or documents with ``by="documents"``).
        order: gives each source's row order for each pass (:func:`pass_order`).
        exhausted: ``"stop"``: the order ends when a source has no row left; ``"repeat"``: a source that runs out
            starts its next pass, and the order ends once every source (of weight > 0) has finished one pass.

    Raises:
        ValueError: a source of weight > 0 that has no row (named by its index; ``MixMode`` names it).
    """

    def __init__(
        self, weights: Sequence[float], sizes: Sequence[np.ndarray], order: PassOrder, exhausted: str = "repeat"
    ) -> None:
        self.weights = [float(w) for w in weights]
        self.sizes = [np.asarray(s, dtype=np.int64).tolist() for s in sizes]  # Python ints: read once per step
        self.order, self.exhausted = order, exhausted
        self.active = [s for s, w in enumerate(self.weights) if w > 0]
        k = len(self.sizes)
        self.served = [0] * k  # t_s: counted units put into rows
        self.rows_served = [0] * k
        self.position = [0] * k  # rows read in the current pass
        self.passes = [0] * k  # passes finished
        self._orders: dict[int, tuple[int, list[int]]] = {}
        self._next = [0] * k  # r_s: the size of each source's next row
        self._total = 0  # T, kept as it grows (the order asks for it every step)
        for s in self.active:
            self._refresh(s)

    def _rows(self, s: int) -> list[int]:
        cached = self._orders.get(s)
        if cached is None or cached[0] != self.passes[s]:
            cached = (self.passes[s], self.order(s, self.passes[s]).tolist())
            self._orders[s] = cached
        return cached[1]

    def _refresh(self, s: int) -> None:
        rows = self._rows(s)
        if not rows:
            raise ValueError(f"source {s} has no row to give")
        self._next[s] = self.sizes[s][rows[self.position[s]]]

    @property
    def done(self) -> bool:
        """Whether the order has ended (``stop``: a source ran out; ``repeat``: every source read once)."""
        finished = sum(1 for s in self.active if self.passes[s] > 0)
        return finished > 0 if self.exhausted == "stop" else finished == len(self.active)

    def pick(self) -> int:
        """The source of the next row (:func:`choose`)."""
        return choose(self.weights, self.served, self._total, self._next)

    def step(self, keep_going: bool = False) -> tuple[int, int]:
        """``(source, row)`` of the next row, and the state moved past it. After :attr:`done`, only with
        ``keep_going`` (``repeat``: ranks that must match a longer rank's batch count read on)."""
        if self.done and not (keep_going and self.exhausted == "repeat"):
            raise StopIteration
        s = self.pick()
        rows = self._rows(s)
        row = rows[self.position[s]]
        self.served[s] += self._next[s]
        self._total += self._next[s]
        self.rows_served[s] += 1
        self.position[s] += 1
        if self.position[s] == len(rows):
            self.passes[s] += 1
            self.position[s] = 0
        self._refresh(s)
        return s, row

    def run(self, limit: int | None = None, keep_going: bool = False) -> tuple[list[int], list[int]]:
        """``(sources, rows)`` of the next rows until the order ends (``keep_going``: until ``limit``), at most
        ``limit``: :meth:`step` repeated, in one loop over local variables (a few times faster; the same order)."""
        weights, served, rows_served, position, passes = (
            self.weights,
            self.served,
            self.rows_served,
            self.position,
            self.passes,
        )
        sizes, nexts, active, stop = self.sizes, self._next, self.active, self.exhausted == "stop"
        unfinished = sum(1 for a in active if passes[a] == 0)
        orders = {a: self._rows(a) for a in active}
        out_s, out_r, total, limit = [], [], self._total, math.inf if limit is None else limit
        while len(out_s) < limit:
            if not keep_going and (unfinished < len(active) if stop else unfinished == 0):
                break
            best, best_finish, margin = -1, math.inf, 1e-9 * max(1, total)
            for a in active:
                w = weights[a]
                if w * total - served[a] >= -margin:
                    finish = (served[a] + nexts[a]) / w
                    if finish < best_finish:
                        best, best_finish = a, finish
            order = orders[best]
            out_s.append(best)
            out_r.append(order[position[best]])
            served[best] += nexts[best]
            total += nexts[best]
            rows_served[best] += 1
            position[best] += 1
            if position[best] == len(order):
                unfinished -= passes[best] == 0
                passes[best] += 1
                position[best] = 0
                order = orders[best] = self._rows(best)
            nexts[best] = sizes[best][order[position[best]]]
        self._total = total
        return out_s, out_r

    def state_dict(self) -> dict[str, Any]:
        """Enough to continue exactly: per source the units and rows served, the position in its pass and the passes
        finished (each pass's order is drawn again from its seed, so no random state is kept)."""
        keys = ("served", "rows_served", "position", "passes")
        return {key: list(getattr(self, key)) for key in keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("served", "rows_served", "position", "passes"):
            value = [int(v) for v in state[key]]
            if len(value) != len(self.sizes):
                raise ValueError(
                    f"The saved mix state has {len(value)} sources and this mix {len(self.sizes)}: resume with "
                    "the same sources (or start the epoch again)."
                )
            setattr(self, key, value)
        self._total = sum(self.served)
        for s in self.active:
            self._refresh(s)

    @property
    def deficits(self) -> np.ndarray:
        """``[sources]`` ``w_s * T - t_s``: how far each source is behind (> 0) or ahead (< 0) of its share."""
        total = sum(self.served)
        return np.asarray([w * total - t for w, t in zip(self.weights, self.served)])


def interleave(interleaver: Interleaver, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``([rows] source, [rows] row)`` until the order ends (or ``limit`` rows)."""
    sources, rows = interleaver.run(limit)
    return np.asarray(sources, dtype=np.int64), np.asarray(rows, dtype=np.int64)
