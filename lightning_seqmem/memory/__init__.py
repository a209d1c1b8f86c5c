"""Memory: cache pre-allocation, allocator settings, a memory monitor, config checks and the memory estimate.

Exports resolve lazily (PEP 562), so ``from lightning_seqmem.memory.allocator import configure_allocator`` (and even
``from lightning_seqmem.memory import configure_allocator``) runs before torch is imported.
"""

from __future__ import annotations

from lightning_seqmem._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "configure_allocator": "lightning_seqmem.memory.allocator",
    "apply_allocator_settings": "lightning_seqmem.memory.allocator",
    "allocator_settings": "lightning_seqmem.memory.allocator",
    "CachePreallocator": "lightning_seqmem.memory.preallocate",
    "PreallocationOOMError": "lightning_seqmem.memory.preallocation_report",
    "PreallocationReport": "lightning_seqmem.memory.preallocation_report",
    "make_dummy_batch": "lightning_seqmem.memory.worst_batch",
    "MemoryMonitor": "lightning_seqmem.memory.monitor",
    "ConfigChecks": "lightning_seqmem.memory.checks",
    "RunFacts": "lightning_seqmem.memory.checks",
    "find_problems": "lightning_seqmem.memory.checks",
    "resolve_precision": "lightning_seqmem.memory.checks",
    "estimate_training_memory": "lightning_seqmem.memory.estimate",
    "MemoryEstimate": "lightning_seqmem.memory.estimate",
    "TraceError": "lightning_seqmem.memory.trace",
    "ModelFacts": "lightning_seqmem.memory.model_facts",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
