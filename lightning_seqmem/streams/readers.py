"""Who reads which shard of a stream, and where each reader stands in it: the position a checkpoint keeps.

A reader is one loader worker of one rank. Shards (a stream's files, or the pieces ``to_iterable_dataset`` cut) are
dealt whole: to ranks when their count divides by the world size, else every rank reads every shard and keeps every
``world``-th document of it (as ``datasets.distributed.split_dataset_by_node`` does); then a rank's shards to its
loader workers in turn (as ``datasets`` does). ``datasets`` reads each shard and keeps its place in it
(``IterableDataset.state_dict``: the table and the row), so a resumed reader seeks to it instead of reading again.
The position of every shard is kept by its index in the whole stream, so a checkpoint can be dealt again to another
number of workers or ranks (:func:`merge_positions`). No Lightning import.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

DONE = "done"
"""The position of a shard read to its end."""


@dataclass(frozen=True)
class Layout:
    """How a stream of ``shards`` shards is dealt to ``world`` ranks of ``workers`` readers each."""

    shards: int
    world: int = 1
    workers: int = 1

    @property
    def whole(self) -> bool:
        """Whether each shard goes to one rank (else every rank reads it and keeps every ``world``-th document)."""
        return self.shards % self.world == 0

    def shards_of(self, rank: int, worker: int) -> list[int]:
        """The shards reader ``(rank, worker)`` reads, in order."""
        mine = range(rank, self.shards, self.world) if self.whole else range(self.shards)
        return list(mine)[worker :: self.workers]

    def stride(self, rank: int) -> tuple[int, int]:
        """``(offset, step)``: which documents of each of its shards the rank keeps."""
        return (0, 1) if self.whole else (rank, self.world)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def can_shard(stream: Any) -> bool:
    """Whether ``stream`` is a ``datasets`` stream whose shards can be read one by one (else it is read in order)."""
    return hasattr(stream, "shard") and hasattr(stream, "num_shards") and hasattr(stream, "load_state_dict")


class ShardReader:
    """The documents of one reader's shards, in order, with the position in each (``positions``: shard index ->
    ``DONE``, or ``{"hf": the shard's datasets state, "rows": rows read of it}``). ``replay`` is told how many rows
    a shard that cannot seek (a generator's) reads again, before it does."""

    def __init__(
        self,
        stream: Any,
        shards: list[int],
        stride: tuple[int, int],
        positions: dict | None = None,
        replay: Callable[[int], None] | None = None,
    ) -> None:
        self.stream, self.shards, self.stride, self.replay = stream, shards, stride, replay
        self.positions: dict[int, Any] = dict(positions or {})
        self._current: list | None = None  # [shard, its datasets stream, rows read of it]

    def __iter__(self) -> Iterator[dict]:
        offset, step = self.stride
        for s in self.shards:
            position = self.positions.get(s)
            if position == DONE:
                continue
            shard = self.stream.shard(num_shards=self.stream.num_shards, index=s, contiguous=True)
            if hasattr(self.stream, "epoch"):
                shard.set_epoch(self.stream.epoch)  # a shuffled stream's order in the shard (not copied by ``shard``)
            skip = 0
            if position is not None and seeks(position["hf"]):
                shard.load_state_dict(position["hf"])
            elif position is not None:  # a generator: read its first rows again, and say so
                skip = position["rows"]
                if self.replay is not None:
                    self.replay(skip)
            self._current = [s, shard, position["rows"] if position else 0]
            # ``iter`` reads in this process as it is: ``__iter__`` inside a loader worker would deal the one shard
            # to the workers again. ``datasets`` counts a row as read once it has handed it out.
            rows = shard.iter(batch_size=1)
            if skip:
                _skip(rows, skip, f"Replaying shard {s} to its position")
            for batch in rows:
                index = self._current[2]
                self._current[2] += 1
                if step == 1 or index % step == offset:
                    yield {k: v[0] for k, v in batch.items()}
            self.positions[s] = DONE
            self._current = None

    def state_dict(self) -> dict[int, Any]:
        """Every shard's position (those not yet started are absent)."""
        positions = dict(self.positions)
        if self._current is not None:
            s, shard, rows = self._current
            positions[s] = {"hf": shard.state_dict(), "rows": rows}
        return positions


def seeks(state: dict) -> bool:
    """Whether a shard's ``datasets`` state can be gone back to without reading its rows again: tables (files,
    Arrow) are skipped whole; a generator (``IterableDataset.from_generator``) would be run through from its start."""
    while "shard_example_idx" not in state and "examples_iterable" in state:
        state = state["examples_iterable"]
    return state.get("type") != "ExamplesIterable"


def _skip(rows: Iterator, count: int, description: str) -> None:
    """Read and drop ``count`` rows, with a progress bar where the output is a terminal."""
    from tqdm.auto import tqdm

    for _ in tqdm(range(count), desc=description, unit=" rows", disable=None, leave=False):
        next(rows)


class OrderedReader:
    """A source that cannot be dealt by shard (a list, a generator): read in order, its position the number of
    documents read; a resumed reader reads those again and drops them (``replay`` says so first)."""

    def __init__(self, stream: Any, read: int = 0, replay: Callable[[int], None] | None = None) -> None:
        self.stream, self.read, self.replay = stream, read, replay

    def __iter__(self) -> Iterator[dict]:
        skip, self.read = self.read, 0
        if skip and self.replay is not None:
            self.replay(skip)
        rows = iter(self.stream)
        if skip:
            _skip(rows, skip, "Replaying the stream to its position")
            self.read = skip
        for row in rows:
            self.read += 1
            yield row

    def state_dict(self) -> int:
        return self.read


class ShuffleBuffer:
    """Documents drawn at random from a buffer of ``size`` (seeded): each new document takes the place of the one
    drawn, and at the end what is left comes out in random order. Its documents and its generator's state are the
    state, so a resumed reader draws exactly as the uninterrupted one (``datasets``' buffer is lost on resume)."""

    def __init__(self, source: Any, size: int, seed: tuple[int, ...], state: dict | None = None) -> None:
        self.source, self.size = source, size
        self.rng = random.Random(hash_seed(seed))
        self.buffer: list[dict] = []
        if state is not None:  # a regrouped reader gets documents and a generator of its own
            self.buffer = list(state["buffer"])
            if state["rng"] is not None:
                self.rng.setstate(_as_tuple(state["rng"]))

    def __iter__(self) -> Iterator[dict]:
        for example in self.source:
            if len(self.buffer) < self.size:
                self.buffer.append(example)
                continue
            j = self.rng.randrange(self.size)
            out, self.buffer[j] = self.buffer[j], example
            yield out
        while self.buffer:
            j = self.rng.randrange(len(self.buffer))
            self.buffer[j], self.buffer[-1] = self.buffer[-1], self.buffer[j]
            yield self.buffer.pop()

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": list(self.buffer), "rng": self.rng.getstate()}


def hash_seed(parts: tuple[int, ...]) -> int:
    """One integer seed from several (the same in every process, unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def _as_tuple(value: Any) -> Any:
    """A generator state back from a checkpoint (tuples may come back as lists)."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def merge_positions(states: list[dict[int, Any]]) -> dict[int, Any]:
    """The position of every shard over several readers' saved positions (each shard was one reader's)."""
    merged: dict[int, Any] = {}
    for positions in states:
        for shard, position in positions.items():
            if merged.get(shard) != DONE:
                merged[shard] = position
    return merged
