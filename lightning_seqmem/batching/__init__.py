"""From documents to batches: truncation, bin packing and packed rows (whole-split and streaming), the packing-plan
cache, samplers, collators, and the strategies (pad, truncate, pack) that choose among them.

The pieces usable without Lightning are gathered here (``from lightning_seqmem.batching import pack_sequences,
PadCollator``); the rest is imported from its module.
"""

from __future__ import annotations

from lightning_seqmem._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "best_fit_decreasing": "lightning_seqmem.batching.bin_packing",
    "exact_fit_patterns": "lightning_seqmem.batching.exact_fit",
    "pack_bins": "lightning_seqmem.batching.bin_packing",
    "repack_partial_rows": "lightning_seqmem.batching.bin_packing",
    "OVERFLOWS": "lightning_seqmem.batching.packed_rows",
    "PACKINGS": "lightning_seqmem.batching.packed_rows",
    "PackResult": "lightning_seqmem.batching.packed_rows",
    "check_packing": "lightning_seqmem.batching.packed_rows",
    "pack_lengths": "lightning_seqmem.batching.packed_rows",
    "pack_sequences": "lightning_seqmem.batching.packed_rows",
    "StreamingPacker": "lightning_seqmem.batching.streaming_packer",
    "PadCollator": "lightning_seqmem.batching.collate",
    "TruncateCollator": "lightning_seqmem.batching.collate",
    "PackCollator": "lightning_seqmem.batching.collate",
    "ShuffledBatchSampler": "lightning_seqmem.batching.sampling",
    "LengthGroupedSampler": "lightning_seqmem.batching.sampling",
    "TokenBudgetBatchSampler": "lightning_seqmem.batching.sampling",
    "BatchingSettings": "lightning_seqmem.batching.settings",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
