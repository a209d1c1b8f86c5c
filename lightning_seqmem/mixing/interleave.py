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
        self.weights = np.asarray(weights, dtype=np.float64)
        self.sizes = [np.asarray(s, dtype=np.int64) for s in sizes]
        self.order, self.exhausted = order, exhausted
        self.active = self.weights > 0
        self.served = np.zeros(len(self.sizes), dtype=np.int64)  # t_s: counted units put into rows
        self.rows_served = np.zeros(len(self.sizes), dtype=np.int64)
        self.position = np.zeros(len(self.sizes), dtype=np.int64)  # rows read in the current pass
        self.passes = np.zeros(len(self.sizes), dtype=np.int64)  # passes finished
        self._orders: dict[int, tuple[int, np.ndarray]] = {}
        self._next = np.zeros(len(self.sizes), dtype=np.int64)  # r_s: the size of each source's next row

        for s in np.flatnonzero(self.active):
            self._refresh(int(s))

    def _rows(self, s: int) -> np.ndarray:
        cached = self._orders.get(s)
        if cached is None or cached[0] != self.passes[s]:
            cached = (int(self.passes[s]), self.order(s, int(self.passes[s])))
            self._orders[s] = cached
        return cached[1]

    def _refresh(self, s: int) -> None:
        rows = self._rows(s)
        if len(rows) == 0:
            raise ValueError(f"source {s} has no row to give")
        self._next[s] = self.sizes[s][rows[self.position[s]]]

    @property
    def done(self) -> bool:
        """Whether the order has ended (``stop``: a source ran out; ``repeat``: every source read once)."""
        if self.exhausted == "stop":
            return bool(np.any(self.passes[self.active] > 0))
        return bool(np.all(self.passes[self.active] > 0))

    def pick(self) -> int:
        """The source of the next row (the rule in the module docstring)."""
        total = self.served.sum()
        deficit = self.weights * total - self.served
        eligible = self.active & (deficit >= -1e-9 * max(1, total))  # rounding of w * T never excludes the fair one
        finish = np.full(len(self.sizes), np.inf)
        finish[eligible] = (self.served[eligible] + self._next[eligible]) / self.weights[eligible]
        return int(np.argmin(finish))

    def step(self, keep_going: bool = False) -> tuple[int, int]:
        """``(source, row)`` of the next row, and the state moved past it. After :attr:`done`, only with
        ``keep_going`` (``repeat``: ranks that must match a longer rank's batch count read on)."""
        if self.done and not (keep_going and self.exhausted == "repeat"):
            raise StopIteration
        s = self.pick()
        row = int(self._rows(s)[self.position[s]])
        self.served[s] += self._next[s]
        self.rows_served[s] += 1
        self.position[s] += 1
        if self.position[s] == len(self._rows(s)):
            self.passes[s] += 1
            self.position[s] = 0
        self._refresh(s)
        return s, row

    def state_dict(self) -> dict[str, Any]:
        """Enough to continue exactly: per source the units and rows served, the position in its pass and the passes
        finished (each pass's order is drawn again from its seed, so no random state is kept)."""
        return {
            "served": self.served.tolist(),
            "rows_served": self.rows_served.tolist(),
            "position": self.position.tolist(),
            "passes": self.passes.tolist(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("served", "rows_served", "position", "passes"):
            value = np.asarray(state[key], dtype=np.int64)
            if value.shape != self.served.shape:
                raise ValueError(
                    f"The saved mix state has {value.size} sources and this mix {self.served.size}: resume with "
                    "the same sources (or start the epoch again)."
                )
            setattr(self, key, value)
        for s in np.flatnonzero(self.active):
            self._refresh(int(s))

    @property
    def deficits(self) -> np.ndarray:
        """``[sources]`` ``w_s * T - t_s``: how far each source is behind (> 0) or ahead (< 0) of its share."""
        return self.weights * self.served.sum() - self.served


def interleave(interleaver: Interleaver, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``([rows] source, [rows] row)`` until the order ends (or ``limit`` rows)."""
    sources, rows = [], []
    while not interleaver.done and (limit is None or len(sources) < limit):
        s, r = interleaver.step()
        sources.append(s)
        rows.append(r)
    return np.asarray(sources, dtype=np.int64), np.asarray(rows, dtype=np.int64)
