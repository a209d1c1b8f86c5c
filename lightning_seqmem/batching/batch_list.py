"""An epoch's batches as index spans, and how many items each batch takes.

``BatchList`` holds the batches of an epoch as three integer arrays (not a Python list per batch) and reduces values
per batch in numpy; ``balanced_batch_sizes`` cuts ``n`` items into batches whose count every rank can share. Both
are what the samplers (``sampling.py``, ``mixing/sampler.py``, a ``Mix``'s read mode) build their batches from, and
what the strategies read shapes from.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence

import numpy as np

__all__ = ["BatchList", "balanced_batch_sizes"]


def _even_split(n: int, parts: int) -> list[int]:
    return [n // parts + (i < n % parts) for i in range(parts)]


def balanced_batch_sizes(n: int, batch_size: int, num_replicas: int = 1, drop_last: bool = False) -> list[int]:
    """Sizes of consecutive batches covering ``n`` items, their count a multiple of ``num_replicas``.

    Full batches first; the last ``num_replicas`` batches share the remainder evenly (none empty), so each rank
    gets the same number of batches without repeating an item. ``drop_last`` keeps only full batches. When
    ``n`` items cannot fill one batch per rank, the tail that cannot be shared is dropped (a warning says so).

    Example::

        >>> balanced_batch_sizes(10, 4, num_replicas=2)
        [4, 4, 1, 1]
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1.")
    per_round = batch_size * num_replicas
    if drop_last or n == 0:
        return [batch_size] * ((n // per_round) * num_replicas)
    rounds = -(-n // per_round)
    tail = n - (rounds - 1) * per_round
    if tail >= num_replicas:
        return [batch_size] * ((rounds - 1) * num_replicas) + _even_split(tail, num_replicas)
    total = rounds * num_replicas
    if n >= total:
        return _even_split(n, total)
    kept = (n // num_replicas) * num_replicas
    warnings.warn(
        f"{n} items cannot give each of {num_replicas} ranks the same number of non-empty batches of <= "
        f"{batch_size}; dropping {n - kept} of them this epoch. Use more data or fewer ranks.",
        stacklevel=3,
    )
    return _even_split(kept, kept) if kept else []


class BatchList(Sequence):
    """Batches as spans of one index array: batch ``i`` is ``order[starts[i]:ends[i]]``, a list only when asked for.

    An epoch of a large dataset is a few hundred thousand batches: kept as three integer arrays, not a Python list
    per batch, and reduced per batch (longest row, real tokens) in numpy.
    """

    def __init__(self, order: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        self.order = np.asarray(order, dtype=np.int64)
        self.starts = np.asarray(starts, dtype=np.int64)
        self.ends = np.asarray(ends, dtype=np.int64)

    @classmethod
    def cut(cls, order: np.ndarray, sizes: Sequence[int] | np.ndarray) -> BatchList:
        """Consecutive batches of ``sizes`` items along ``order``."""
        bounds = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))])
        return cls(order, bounds[:-1], bounds[1:])

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return BatchList(self.order, self.starts[i], self.ends[i])
        return self.order[self.starts[i] : self.ends[i]].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order
        for a, b in zip(self.starts.tolist(), self.ends.tolist()):
            yield order[a:b].tolist()

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Sequence) and len(self) == len(other) and all(a == list(b) for a, b in zip(self, other))
        )

    def __repr__(self) -> str:
        return f"BatchList({len(self)} batches, {int(self.sizes.sum())} items)"

    def take(self, index: np.ndarray) -> BatchList:
        """The batches at ``index``, in that order."""
        return BatchList(self.order, self.starts[index], self.ends[index])

    @property
    def sizes(self) -> np.ndarray:
        """``[batches]`` items per batch."""
        return self.ends - self.starts

    def reduce(self, values: np.ndarray, ufunc: np.ufunc = np.add) -> np.ndarray:
        """``[batches]``: ``ufunc`` over ``values[batch]`` for each (non-empty) batch, e.g. longest row, tokens."""
        if len(self) == 0:
            return np.zeros(0, dtype=np.asarray(values).dtype)
        by_start = np.argsort(self.starts, kind="stable")  # spans never overlap: sorted, they interleave cleanly
        bounds = np.empty(2 * len(self), dtype=np.int64)
        bounds[0::2], bounds[1::2] = self.starts[by_start], self.ends[by_start]
        flat = np.append(np.asarray(values)[self.order], 0)  # a spare element: a span may end at the last item
        out = np.empty(len(self), dtype=flat.dtype)
        out[by_start] = ufunc.reduceat(flat, bounds)[0::2]
        return out
