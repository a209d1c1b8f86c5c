"""lightning_seqmem: less padding, less memory and no CUDA out-of-memory surprises for Lightning LM training.

Exports are resolved lazily (PEP 562): ``import lightning_seqmem`` does not import torch, so entry points can
configure the CUDA caching allocator (``PYTORCH_ALLOC_CONF``) before torch reads it. To add an export, add one
``name: module`` line to ``_EXPORTS``.
"""

from __future__ import annotations

from lightning_seqmem import _moved, _process_exit
from lightning_seqmem._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # foundation
    "CausalLM": "lightning_seqmem.training.model",
    "DPO": "lightning_seqmem.training.dpo",
    "SeqMemDataModule": "lightning_seqmem.datamodule.module",
    "load_builtin_corpus": "lightning_seqmem.data.corpus",
    "load_tokenizer": "lightning_seqmem.data.tokenizer",
    "RunSummary": "lightning_seqmem.apps.summary",
    # data strategies: packing, truncation, collators, samplers, metrics
    "pack_sequences": "lightning_seqmem.batching",
    "pack_lengths": "lightning_seqmem.batching",
    "PackResult": "lightning_seqmem.batching",
    "StreamingPacker": "lightning_seqmem.batching",
    "PadCollator": "lightning_seqmem.batching.collate",
    "TruncateCollator": "lightning_seqmem.batching.collate",
    "PackCollator": "lightning_seqmem.batching.collate",
    "IGNORE_INDEX": "lightning_seqmem.batch",
    "real_token_mask": "lightning_seqmem.batch",
    "count_real_tokens": "lightning_seqmem.batch",
    "count_label_tokens": "lightning_seqmem.batch",
    "ShuffledBatchSampler": "lightning_seqmem.batching.sampling",
    "LengthGroupedSampler": "lightning_seqmem.batching.sampling",
    "TokenBudgetBatchSampler": "lightning_seqmem.batching.sampling",
    "TokenEfficiency": "lightning_seqmem.training.metrics",
    # sequence-length warmup
    "SeqLengthWarmup": "lightning_seqmem.warmup",
    "set_batch_sequence_length": "lightning_seqmem.warmup",
    "apply_seq_length_warmup": "lightning_seqmem.warmup",
    "seq_length_at": "lightning_seqmem.warmup",
    # memory: cache pre-allocation, allocator settings, memory monitor, config checks
    "CachePreallocator": "lightning_seqmem.memory",
    "MemoryMonitor": "lightning_seqmem.memory",
    "ConfigChecks": "lightning_seqmem.memory",
    "configure_allocator": "lightning_seqmem.memory",
    "resolve_precision": "lightning_seqmem.memory",
    # training correctness: flash varlen arguments for packed batches, token-weighted loss
    "flash_varlen_kwargs": "lightning_seqmem.training.varlen",
    "TokenLossNormalizer": "lightning_seqmem.training.loss",
    # composition: per-job progress records for sweeps
    "JobRecord": "lightning_seqmem.apps.job_record",
    "FinalValidation": "lightning_seqmem.training.final_validation",
    "StepProgressBar": "lightning_seqmem.training.progress",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

# Old flat module paths (lightning_seqmem.varlen, ...) resolve to their folders.
_moved.register(__name__)

# Every rank imports the package (spawned ranks unpickle its objects): close a process group left open at exit.
_process_exit.register()
