"""A stream reader's saved position, typed: what torchdata keeps per loader worker and a checkpoint holds (one
stream's reader, :class:`ReaderState`; the mixer of several, :class:`MixerState`).

Plain values only (ints, lists, dicts of them), so a checkpoint loads with ``torch.load(weights_only=True)``;
:meth:`ReaderState.to_dict`/:meth:`ReaderState.from_dict` are the one place its fields are named. No Lightning
import.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["MixerState", "ReaderState"]


class _PlainState:
    """To and from the plain dict a loader snapshot and a checkpoint hold."""

    def to_dict(self) -> dict[str, Any]:
        """Plain values, for torchdata's snapshots and checkpoints."""
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]):
        """A saved state (keys this version does not know are ignored; missing ones take their defaults)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in state.items() if k in known})


@dataclass
class ReaderState(_PlainState):
    """Where one reader (a loader worker of one rank) stands in a stream.

    Attributes:
        epoch: the epoch it was reading.
        passes: passes over its shards finished (a stream repeated under DDP).
        index: documents numbered in this pass (the packer's document ids).
        positions: per shard index, ``"done"`` or the ``datasets`` state and rows read (``readers.ShardReader``).
        window: the packing window's waiting documents and ready rows (``PackingWindow.state_dict``).
        counts: its counts (``StreamCounts.FIELDS`` order) behind ``stats()``.
        pass_start: the counts' rows and documents left out when this pass began.
        shuffled: the shuffle buffer's documents and generator (``readers.ShuffleBuffer``).
        layout: how the stream was dealt (``readers.Layout.as_dict``; ``None``: read in order).
        rank, worker: whose reader it was.
        fresh: it had read nothing (the next pass starts at the epoch's first document).
    """

    epoch: int = 0
    passes: int = 0
    index: int = 0
    positions: Any = field(default_factory=dict)
    window: dict[str, Any] | None = None
    counts: list[int] | None = None
    pass_start: list[int] | None = None
    shuffled: dict[str, Any] | None = None
    layout: dict[str, int] | None = None
    rank: int = 0
    worker: int = 0
    fresh: bool = False


@dataclass
class MixerState(_PlainState):
    """Where a mix of streams (``mixed.MixedRows``) stands, per source in source order.

    Attributes:
        epoch: the epoch it was reading.
        served: units (tokens or documents) each source has put into rows.
        rows: rows each source has given.
        passes: passes each source has finished.
        total: units of every source together.
        heads: per source index, the row it has read ahead (as tensors), or ``"end"``.
        sources: each source's own state (a :class:`ReaderState` as a dict), or ``None``.
        fresh: it had read nothing.
    """

    epoch: int = 0
    served: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    passes: list[int] = field(default_factory=list)
    total: int = 0
    heads: dict[int, Any] = field(default_factory=dict)
    sources: list[Any] = field(default_factory=list)
    fresh: bool = False
