"""Batch samplers: shuffled, length-grouped and token-budget batches, sharded over DDP ranks, resumable mid-epoch.

Every sampler here yields *batches* (lists of dataset indices) and owns its DDP sharding:

- all ranks build the same global list of batches from ``seed + epoch`` (so packing and order agree everywhere),
  then take every ``num_replicas``-th batch; the global count is a multiple of ``num_replicas``, so every rank
  yields the same number of batches and no rank hangs at the end of an epoch;
- no index is lost or repeated: the last batches are shrunk instead of padded with repeats (``drop_last=True``
  drops the incomplete tail instead, and ``num_dropped`` says how many);
- they subclass ``DistributedSampler`` so Lightning does not inject its own sampler; use them as a DataLoader's
  ``sampler`` with ``batch_size=None`` over a dataset that takes a list of indices (``BatchFetcher``).

``state_dict``/``load_state_dict`` hold the epoch and the batches already yielded, so a resumed run yields exactly
the remaining batches (torchdata's ``StatefulDataLoader`` picks them up automatically).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

from lightning_seqmem.batching.batch_list import BatchList, balanced_batch_sizes


def _world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """Explicit values, else the initialised process group, else a single process."""
    initialised = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank={rank} must be in [0, num_replicas={num_replicas}).")
    return num_replicas, rank


class _ShardedBatchSampler(DistributedSampler):
    """Shared machinery: epoch seeding, sharding, longest-first, resume. Subclasses build ``global_batches``."""

    def __init__(
        self,
        num_items: int,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
    ) -> None:
        num_replicas, rank = _world(num_replicas, rank)
        super().__init__(
            range(num_items), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        self.num_items = num_items
        self._yielded = 0
        self._skip = 0

    def global_batches(self, epoch: int) -> BatchList:
        """All ranks' batches for ``epoch``; the count is a multiple of ``num_replicas``."""
        raise NotImplementedError

    def batch_cost(self, batch: list[int]) -> float:
        """Used to put the most expensive batch first (an OOM shows at step 0); 0 keeps the order."""
        return float(self.batch_costs(BatchList.cut(np.asarray(batch, dtype=np.int64), [len(batch)]))[0])

    def batch_costs(self, batches: BatchList) -> np.ndarray:
        """``[batches]`` cost of each batch, vectorised (``batch_cost`` for one); zeros keep the order."""
        return np.zeros(len(batches))

    def batches(self, epoch: int | None = None) -> BatchList:
        """This rank's batches for ``epoch`` (default: the current one), the most expensive first."""
        everyone = self.global_batches(self.epoch if epoch is None else epoch)
        mine = np.arange(self.rank, len(everyone), self.num_replicas)
        if mine.size:
            top = int(np.argmax(self.batch_costs(everyone.take(mine))))  # the first of equals, as max() gives
            mine[0], mine[top] = mine[top], mine[0]
        return everyone.take(mine)

    @property
    def num_dropped(self) -> int:
        """Items of an epoch that no rank sees (only with ``drop_last`` or fewer items than ranks)."""
        return self.num_items - int(self.global_batches(self.epoch).sizes.sum())

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.batches()
        start, self._skip = self._skip, 0
        self._yielded = start
        for batch in batches[start:]:
            self._yielded += 1
            yield batch

    def __len__(self) -> int:
        """Batches per rank per epoch: the same on every rank and in every epoch."""
        return self.num_global_batches // self.num_replicas

    @property
    def num_global_batches(self) -> int:
        return len(self.global_batches(self.epoch))

    def state_dict(self) -> dict[str, Any]:
        """Epoch, seed and batches already yielded this epoch (enough to replay the rest exactly)."""
        return {"epoch": self.epoch, "seed": self.seed, "batches_yielded": self._yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"resuming with seed={self.seed} but the state was saved with seed={state['seed']}.")
        self.epoch = state["epoch"]
        self._skip = self._yielded = state["batches_yielded"]


class ShuffledBatchSampler(_ShardedBatchSampler):
    """Fixed-size batches in a fresh order each epoch (``seed + epoch``): for packed rows and plain padding.

    Args:
        num_items: dataset size.
        batch_size: rows per batch (the last batches of an epoch may be smaller, never empty).
        shuffle: reshuffle each epoch; ``False`` keeps dataset order (validation).
        seed: the same on every rank.
        num_replicas, rank: DDP world; default from the initialised process group, else 1 and 0.
        drop_last: drop the incomplete tail instead of shrinking the last batches.

    Example::

        >>> s = ShuffledBatchSampler(5, batch_size=2, shuffle=False)
        >>> list(s)
        [[0, 1], [2, 3], [4]]
    """

    def __init__(
        self,
        num_items: int,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
    ) -> None:
        super().__init__(num_items, shuffle, seed, num_replicas, rank, drop_last)
        self.batch_size = batch_size
        self._sizes = balanced_batch_sizes(num_items, batch_size, self.num_replicas, drop_last)

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_items)
        return np.random.default_rng(self.seed + epoch).permutation(self.num_items)

    def global_batches(self, epoch: int) -> BatchList:
        return BatchList.cut(self._order(epoch), self._sizes)

    @property
    def num_global_batches(self) -> int:
        return len(self._sizes)

    @property
    def num_dropped(self) -> int:
        return self.num_items - int(sum(self._sizes))


class LengthGroupedSampler(ShuffledBatchSampler):
    """Batches of similar length: shuffle, cut into mega-batches, sort each by length (longest first).

    Padding falls because rows of a batch have similar lengths; randomness stays because mega-batches are drawn
    afresh each epoch. Neighbouring batches (same step on different ranks) have similar shapes, and each rank's
    longest batch comes first, so an out-of-memory error shows up at step 0.

    Args:
        lengths: ``[items]`` token counts (after truncation).
        batch_size: rows per batch.
        mega_batch_mult: a mega-batch holds ``mega_batch_mult * batch_size * num_replicas`` items.
        shuffle, seed, num_replicas, rank, drop_last: as in ``ShuffledBatchSampler``.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        batch_size: int,
        mega_batch_mult: int = 50,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
    ) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        super().__init__(len(self.lengths), batch_size, shuffle, seed, num_replicas, rank, drop_last)
        self.mega_batch_size = max(1, mega_batch_mult) * batch_size * self.num_replicas

    def _order(self, epoch: int) -> np.ndarray:
        order = super()._order(epoch)
        megas = [order[i : i + self.mega_batch_size] for i in range(0, len(order), self.mega_batch_size)]
        return np.concatenate([m[np.argsort(-self.lengths[m], kind="stable")] for m in megas] or [order])

    def batch_costs(self, batches: BatchList) -> np.ndarray:
        return batches.reduce(self.lengths, np.maximum).astype(np.float64) * batches.sizes


class TokenBudgetBatchSampler(_ShardedBatchSampler):
    """A variable number of rows per batch with ``rows x padded_length <= max_tokens_per_batch``.

    Rows are sorted by length once (ties in a seeded random order) and cut greedily into batches, so memory per
    batch is flat and padding is minimal; each epoch reshuffles the order of the batches (``seed + epoch``), the
    largest batch first. The batch count is fixed, made a multiple of ``num_replicas`` by halving the batches
    with the most rows.

    Args:
        lengths: ``[items]`` token counts (after truncation).
        max_tokens_per_batch: the budget on padded slots per batch.
        padded_length: maps a batch's longest row to its padded length (e.g. ``PadCollator.padded_length``).
        shuffle, seed, num_replicas, rank, drop_last: as in ``ShuffledBatchSampler``; ``drop_last`` drops
            batches instead of splitting to reach a multiple of ``num_replicas``.

    Raises:
        ValueError: the budget cannot hold even the longest row; the message gives the smallest valid budget.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        max_tokens_per_batch: int,
        padded_length: Callable[[int], int] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
    ) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        super().__init__(len(self.lengths), shuffle, seed, num_replicas, rank, drop_last)
        self.max_tokens_per_batch = max_tokens_per_batch
        self.padded_length = padded_length or (lambda n: n)
        one_row = self.padded_length(int(self.lengths.max(initial=1)))
        if max_tokens_per_batch < one_row:
            raise ValueError(
                f"max_tokens_per_batch={max_tokens_per_batch} is smaller than one row: the longest row pads to "
                f"{one_row} tokens. Set max_tokens_per_batch >= {one_row} (or lower max_length)."
            )
        self._batches = self._make_batches()

    def _make_batches(self) -> BatchList:
        tie_break = np.random.default_rng(self.seed).permutation(self.num_items)
        order = tie_break[np.argsort(-self.lengths[tie_break], kind="stable")]
        longest_first = self.lengths[order].tolist()
        spans: list[list[int]] = []
        start = 0
        while start < len(order):  # one step per batch: longest first, so its first row sets the width
            rows = max(1, self.max_tokens_per_batch // self.padded_length(int(longest_first[start])))
            spans.append([start, min(start + rows, len(order))])
            start += rows
        spans = self._balance(spans)
        bounds = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
        return BatchList(order, bounds[:, 0], bounds[:, 1])

    def _balance(self, spans: list[list[int]]) -> list[list[int]]:
        """Halve the batches with the most rows until the count is a multiple of ``num_replicas``."""
        while len(spans) % self.num_replicas:
            if self.drop_last:
                return spans[: len(spans) - len(spans) % self.num_replicas]
            big = max(range(len(spans)), key=lambda i: spans[i][1] - spans[i][0])
            a, b = spans[big]
            if b - a < 2:
                raise ValueError(
                    f"{len(spans)} single-row batches cannot be shared equally by {self.num_replicas} ranks; "
                    "raise max_tokens_per_batch, or pass drop_last=True."
                )
            half = a + (b - a) // 2
            spans[big : big + 1] = [[a, half], [half, b]]
        return spans

    def global_batches(self, epoch: int) -> BatchList:
        if not self.shuffle:
            return self._batches
        return self._batches.take(np.random.default_rng(self.seed + epoch).permutation(len(self._batches)))

    def batch_costs(self, batches: BatchList) -> np.ndarray:
        longest = batches.reduce(self.lengths, np.maximum).tolist()
        return np.asarray([float(self.padded_length(int(n))) for n in longest]) * batches.sizes

    @property
    def num_global_batches(self) -> int:
        return len(self._batches)


class BatchFetcher(Dataset):
    """Wrap a dataset so that one "item" is a whole batch: ``fetcher[[3, 7, 9]] -> [ds[3], ds[7], ds[9]]``.

    With ``DataLoader(BatchFetcher(ds), sampler=<a sampler above>, batch_size=None, collate_fn=collator)`` the
    collator receives the list of examples of each batch.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: list[int]) -> list[Any]:
        return [self.dataset[int(i)] for i in indices]
