"""lightning_seqmem: less padding, less memory and no CUDA out-of-memory surprises for Lightning LM training.

The top level exports what users put in their own training script: the DataModule and its batching options, the
models, the callbacks and the few functions called by hand. Everything else is imported from its folder
(``lightning_seqmem.batching`` for packing, collators and samplers; ``lightning_seqmem.apps.summary`` for
``RunSummary``; ...).

Exports are resolved lazily (PEP 562): ``import lightning_seqmem`` does not import torch, so
``from lightning_seqmem import configure_allocator`` can set ``PYTORCH_ALLOC_CONF`` before torch reads it. To add an
export, add one ``name: module`` line to ``_EXPORTS``.
"""

from __future__ import annotations

from lightning_seqmem import _process_exit
from lightning_seqmem._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # data and models
    "SeqMemDataModule": "lightning_seqmem.datamodule.module",
    "Pad": "lightning_seqmem.batching.options",
    "Truncate": "lightning_seqmem.batching.options",
    "Pack": "lightning_seqmem.batching.options",
    "Mix": "lightning_seqmem.mixing.spec",
    "load_tokenizer": "lightning_seqmem.data.tokenizer",
    "CausalLM": "lightning_seqmem.training.model",
    "DPO": "lightning_seqmem.training.dpo",
    # callbacks
    "SeqLengthWarmup": "lightning_seqmem.warmup.callback",
    "CachePreallocator": "lightning_seqmem.memory.preallocate",
    "MemoryMonitor": "lightning_seqmem.memory.monitor",
    "ConfigChecks": "lightning_seqmem.memory.checks",
    "FinalValidation": "lightning_seqmem.training.final_validation",
    "StepProgressBar": "lightning_seqmem.training.progress",
    # functions and helpers for a model or loop of one's own
    "configure_allocator": "lightning_seqmem.memory.allocator",
    "flash_varlen_kwargs": "lightning_seqmem.training.varlen",
    "TokenLossNormalizer": "lightning_seqmem.training.loss",
    "linear_cross_entropy": "lightning_seqmem.training.linear_cross_entropy",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

# Every rank imports the package (spawned ranks unpickle its objects): close a process group left open at exit.
_process_exit.register()
