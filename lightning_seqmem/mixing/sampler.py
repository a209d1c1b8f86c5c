"""The mixed training sampler: batches are consecutive rows of each rank's interleaved order.

Every rank computes every rank's order (``interleave.Interleaver`` over the rank's own rows of each source:
``pass_order``), so the ranks agree on the batch count without talking: ``exhausted="stop"`` cuts every rank to the
shortest, ``"repeat"`` lets the shorter ranks read on (repeating) to the longest. Each rank's batches then hold the
share bound of ``interleave`` at every batch boundary, and together the ranks read each row at most once per pass.
No torch beyond the sampler base class; no Lightning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lightning_seqmem.batching.batch_list import BatchList
from lightning_seqmem.batching.sampling import _ShardedBatchSampler
from lightning_seqmem.mixing.interleave import Interleaver, pass_order


def row_tokens(lengths: np.ndarray) -> np.ndarray:
    """``[rows]`` the real tokens of each training row: its length, or both sides of a padded pair (whose row
    lengths are ``[pairs, 2]``)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return lengths.sum(axis=1) if lengths.ndim == 2 else lengths


def row_widths(lengths: np.ndarray) -> np.ndarray:
    """``[rows]`` what a token budget pads each training row to: its length, or a padded pair's longer side."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return lengths.max(axis=1) if lengths.ndim == 2 else lengths


def mixed_sampler(
    weights: Sequence[float],
    units: Sequence[np.ndarray],
    lengths: Sequence[np.ndarray],
    exhausted: str,
    strategy: Any,
    seed: int,
    num_replicas: int | None = None,
    rank: int | None = None,
) -> MixedBatchSampler:
    """The training sampler of a mix batched by ``strategy`` (the run's, ``MixMode``, and the planner's alike).

    Rows per batch, the token budget and padded lengths come from ``strategy.row_planner``, the strategy that batches
    its rows: padded pairs are batched one row per pair, by the longer side, as their own sampler batches them, so a
    batch of a mix holds ``micro_batch_size`` pairs as a batch of one source does.
    """
    planner = strategy.row_planner
    s = planner.settings
    budget = s.max_tokens_per_batch if planner.budget_shapes else None
    return MixedBatchSampler(
        weights,
        units,
        [row_widths(n) for n in lengths],
        exhausted,
        None if budget else planner.rows_per_batch("train"),
        seed=seed,
        num_replicas=num_replicas,
        rank=rank,
        drop_last=s.drop_last,
        max_tokens_per_batch=budget,
        padded_length=planner.padded_length if budget else None,
    )


class MixedBatchSampler(_ShardedBatchSampler):
    """Batches of a mix, as lists of indices into the sources' rows laid end to end (``offsets``).

    Args:
        weights: ``[sources]`` shares summing to 1.
        units: per source, ``[rows]`` what a weight counts in each row (tokens or documents).
        lengths: per source, ``[rows]`` each row's length as a token budget pads it (``row_widths``: a padded
            pair's longer side), what the budget cuts batches on.
        exhausted: ``"stop"`` or ``"repeat"`` (``Mix``).
        batch_rows: rows per batch; ``None`` with ``padded_length`` and ``max_tokens_per_batch``: as many
            consecutive rows as the budget holds (rows x padded longest row).
        seed, num_replicas, rank, drop_last: as in ``batching.sampling.ShuffledBatchSampler``.
    """

    def __init__(
        self,
        weights: Sequence[float],
        units: Sequence[np.ndarray],
        lengths: Sequence[np.ndarray],
        exhausted: str,
        batch_rows: int | None,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
        max_tokens_per_batch: int | None = None,
        padded_length: Callable[[int], int] | None = None,
    ) -> None:
        self.weights, self.exhausted = list(weights), exhausted
        self.units = [np.asarray(u, dtype=np.int64) for u in units]
        self.lengths = [np.asarray(n, dtype=np.int64) for n in lengths]
        self.offsets = np.concatenate([[0], np.cumsum([len(n) for n in self.lengths])]).astype(np.int64)
        self.flat_lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        super().__init__(int(self.offsets[-1]), True, seed, num_replicas, rank, drop_last)
        self.batch_rows, self.budget = batch_rows, max_tokens_per_batch
        self.padded_length = padded_length or _unpadded
        self._plans: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}

    # ------------------------------------------------------------------------------------------------- plan
    def _interleaver(self, epoch: int, rank: int) -> Interleaver:
        order = pass_order(self.seed, epoch, [len(n) for n in self.lengths], rank, self.num_replicas)
        return Interleaver(self.weights, self.units, order, self.exhausted)

    def _bounds(self, rows: np.ndarray, closed: bool) -> np.ndarray:
        """``[batches + 1]`` bounds of consecutive batches along ``rows`` (global row indices): ``batch_rows`` each,
        or as many as the token budget holds. ``closed``: the order has ended, so a last shorter batch is served
        (unless ``drop_last``); else only batches the next row would not join."""
        n = len(rows)
        if self.budget is None:
            bounds = list(range(0, n + 1, self.batch_rows))
        else:
            bounds, longest = [0], 0
            for i, length in enumerate(self.flat_lengths[rows].tolist()):
                widest = self.padded_length(max(longest, length))
                if i > bounds[-1] and (i - bounds[-1] + 1) * widest > self.budget:
                    bounds.append(i)
                    longest = 0
                longest = max(longest, length)
        if bounds[-1] < n and closed and (self.budget is not None or not self.drop_last):
            bounds.append(n)
        return np.asarray(bounds, dtype=np.int64)

    def _rank_plan(self, epoch: int, rank: int) -> tuple[Interleaver, list[int]]:
        """``rank``'s interleaver run to the end of its order, and the order (global row indices)."""
        it = self._interleaver(epoch, rank)
        return it, self._global(*it.run())

    def _global(self, sources: list[int], rows: list[int]) -> list[int]:
        offsets = self.offsets.tolist()
        return [offsets[s] + r for s, r in zip(sources, rows)]

    def _extend(self, it: Interleaver, rows: list[int], target: int) -> tuple[np.ndarray, np.ndarray]:
        """``repeat``: read on (the sources repeating) until the order holds ``target`` whole batches."""
        while True:
            bounds = self._bounds(np.asarray(rows, dtype=np.int64), closed=False)
            if len(bounds) > target:
                return np.asarray(rows[: bounds[target]], dtype=np.int64), bounds[: target + 1]
            more = max(64, 2 * (target + 1 - len(bounds)) * (self.batch_rows or 8))
            rows += self._global(*it.run(more, keep_going=True))

    def rank_plans(self, epoch: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Every rank's ``(rows, bounds)`` for ``epoch``, with the same batch count (computed once per epoch)."""
        if epoch not in self._plans:
            runs = [self._rank_plan(epoch, r) for r in range(self.num_replicas)]
            plans = [
                (np.asarray(rows, dtype=np.int64), self._bounds(np.asarray(rows, dtype=np.int64), True))
                for _, rows in runs
            ]
            counts = [len(b) - 1 for _, b in plans]
            if self.exhausted == "repeat":
                plans = [
                    p if len(p[1]) - 1 == max(counts) else self._extend(it, rows, max(counts))
                    for p, (it, rows) in zip(plans, runs)
                ]
            else:
                n = min(counts)
                plans = [(rows[: b[n]], b[: n + 1]) for rows, b in plans]
            self._plans = {epoch: plans}  # one epoch kept: a resumed or next epoch plans again
        return self._plans[epoch]

    def global_batches(self, epoch: int) -> BatchList:
        """Rank ``r``'s batch ``i`` at ``i * num_replicas + r``: the base class deals them back in order."""
        plans = self.rank_plans(epoch)
        order = np.concatenate([rows for rows, _ in plans])
        shift = np.cumsum([0] + [len(rows) for rows, _ in plans[:-1]])
        starts = np.stack([b[:-1] + k for (_, b), k in zip(plans, shift)], axis=1).reshape(-1)
        ends = np.stack([b[1:] + k for (_, b), k in zip(plans, shift)], axis=1).reshape(-1)
        return BatchList(order, starts, ends)

    @property
    def num_dropped(self) -> int:
        """Rows of an epoch no rank reads (``stop``: what is left when the first source runs out)."""
        read = np.unique(np.concatenate([rows for rows, _ in self.rank_plans(self.epoch)]))
        return self.num_items - len(read)

    # --------------------------------------------------------------------------------------------- counts
    def source_of(self, rows: np.ndarray) -> np.ndarray:
        """``[rows]`` the source of each global row index."""
        return np.searchsorted(self.offsets, rows, side="right") - 1

    def source_counts(self, epoch: int = 0) -> list[dict[str, float]]:
        """Per source, this rank's epoch: rows, tokens and counted units read, passes over its share (``repeats``:
        passes beyond the first, whole or begun), rows of its share never read."""
        rows, _ = self.rank_plans(epoch)[self.rank]
        src = self.source_of(rows)
        out = []
        for s in range(len(self.lengths)):
            local = rows[src == s] - self.offsets[s]
            share = len(range(self.rank, len(self.lengths[s]), self.num_replicas))
            read = len(local)
            out.append(
                {
                    "rows": read,
                    "tokens": int(self.lengths[s][local].sum()),
                    "units": int(self.units[s][local].sum()),
                    "passes": read / share if share else 0.0,
                    "repeats": max(0, -(-read // share) - 1) if share else 0,
                    "rows_unread": max(0, share - len(np.unique(local))),
                }
            )
        return out

    # --------------------------------------------------------------------------------------------- resume
    def mixer_state(self, batches: int, epoch: int | None = None) -> dict[str, Any]:
        """The interleaver's state (``Interleaver.state_dict``) after this rank's first ``batches`` batches."""
        epoch = self.epoch if epoch is None else epoch
        _, bounds = self.rank_plans(epoch)[self.rank]
        it = self._interleaver(epoch, self.rank)
        it.run(int(bounds[min(batches, len(bounds) - 1)]), keep_going=True)
        return it.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """The base class's position, with the mixer's state at it: served units and rows, each source's position
        in its pass and its passes (the deficits follow from them and the weights)."""
        return dict(super().state_dict(), mixer=self.mixer_state(self._yielded))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved batch; the mixer's saved state must be the one this mix reaches there."""
        super().load_state_dict(state)
        saved = state.get("mixer")
        if saved is not None and saved != self.mixer_state(self._skip):
            raise ValueError(
                "The checkpoint's mix state (rows served per source, positions, passes) is not the one this mix "
                "reaches at the saved batch: the sources, their rows or the weights changed. Resume with the same "
                "mix, or pass on_resume_mismatch='restart_epoch'."
            )


def _unpadded(length: int) -> int:
    """A row's length in its batch when batches are not padded (a module function: the sampler pickles)."""
    return length
