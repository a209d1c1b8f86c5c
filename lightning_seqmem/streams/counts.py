"""What a stream's loader has read so far, per loader worker, in shared memory. No Lightning import."""

from __future__ import annotations

import torch

from lightning_seqmem.kinds.base import DOCUMENT_STATS
from lightning_seqmem.kinds.detect import STREAM_KINDS
from lightning_seqmem.streams.splits import LEFT_OUT

__all__ = ["StreamCounts"]


class StreamCounts:
    """What a stream's loader has read so far on this process, loader workers included: documents, tokens, and
    every token ``max_length`` took (the keys of map-style ``stats()``).

    One row of a shared-memory table per worker (each writes only its own row), so the main process reads the
    workers' counts while they run, and they outlive the workers.
    """

    SUMMED = (
        *(key for key in DOCUMENT_STATS if key != "longest_document"),
        *dict.fromkeys(key for kind in STREAM_KINDS for key in kind.stats_keys),  # each kind's own, once
        "rows",
        LEFT_OUT,
    )
    FIELDS = SUMMED + ("longest_document",)

    def __init__(self, workers: int = 0) -> None:
        self.table = torch.zeros(max(1, workers), len(self.FIELDS), dtype=torch.int64).share_memory_()

    def totals(self) -> dict[str, int]:
        """The counts summed over workers (``longest_document``: the longest)."""
        table = self.table.clone()
        totals = {name: int(table[:, i].sum()) for i, name in enumerate(self.SUMMED)}
        return dict(totals, longest_document=int(table[:, -1].max()))
