"""Packing: many short documents into few fixed-length rows, documents kept apart as segments.

The work is split by concern; this module gathers the public names so ``from lightning_seqmem.packing import ...``
keeps working:

- ``bin_packing``: best-fit decreasing and the exact repack, on lengths only;
- ``packed_rows``: ``pack_lengths``/``pack_sequences`` and the ``PackResult`` row layout (overflow handling,
  ``wrapped`` packing, tokens gathered on demand from a ``tokens.TokenSource``);
- ``streaming_packer``: ``StreamingPacker`` for unbounded streams.
"""

from __future__ import annotations

from lightning_seqmem.bin_packing import best_fit_decreasing, exact_fit_patterns, pack_bins, repack_partial_rows
from lightning_seqmem.packed_rows import (
    OVERFLOWS,
    PACKINGS,
    PackResult,
    check_packing,
    pack_lengths,
    pack_sequences,
)
from lightning_seqmem.streaming_packer import StreamingPacker

__all__ = [
    "OVERFLOWS", "PACKINGS", "PackResult", "StreamingPacker", "best_fit_decreasing", "check_packing",
    "exact_fit_patterns", "pack_bins", "pack_lengths", "pack_sequences", "repack_partial_rows",
]
