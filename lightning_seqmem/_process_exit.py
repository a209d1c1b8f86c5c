"""Destroy a process group still open at interpreter exit.

A rank that exits without ``destroy_process_group()`` (Lightning's DDP strategies leave the default group open) can
abort in finalization: Gloo's worker threads still hold work objects with tensors, and destroying them then needs
the GIL of an interpreter that is going away ("terminate called without an active exception", SIGABRT, seen on
CPU ``ddp_spawn`` runs after fit had finished). An ``atexit`` handler runs while the interpreter is still whole.
It imports nothing: a process that never imported ``torch.distributed`` has no group to close.
"""

from __future__ import annotations

import atexit
import sys


def destroy_open_process_group() -> bool:
    """Destroy the default process group if one is open; True when it did. Never raises (it runs at exit)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return False
        dist.destroy_process_group()
        return True
    except Exception:  # an exit hook must not turn a finished run into a failed one
        return False


def register() -> None:
    """Register :func:`destroy_open_process_group` at exit, once per process."""
    atexit.unregister(destroy_open_process_group)
    atexit.register(destroy_open_process_group)
