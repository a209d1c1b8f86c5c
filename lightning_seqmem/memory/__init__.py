"""Memory: cache pre-allocation, allocator settings, a memory monitor and config checks.

Exports resolve lazily (PEP 562), so ``from lightning_seqmem.memory.allocator import configure_allocator`` (and even
``from lightning_seqmem.memory import configure_allocator``) runs before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "configure_allocator": "allocator",
    "apply_allocator_settings": "allocator",
    "allocator_settings": "allocator",
    "CachePreallocator": "preallocate",
    "PreallocationOOMError": "preallocate",
    "PreallocationReport": "preallocate",
    "make_dummy_batch": "preallocate",
    "MemoryMonitor": "monitor",
    "ConfigChecks": "checks",
    "RunFacts": "checks",
    "find_problems": "checks",
    "resolve_precision": "checks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_seqmem.memory' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
