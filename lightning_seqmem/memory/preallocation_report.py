"""What a pre-allocation pass did (``CachePreallocator.report``), and the error it raises when the worst-case batch
does not fit: the pass's outcome, kept apart from the callback that runs it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightning_seqmem.batch import Layout
from lightning_seqmem.memory import stats

__all__ = ["PreallocationOOMError", "PreallocationReport"]


class PreallocationOOMError(torch.OutOfMemoryError):
    """The worst-case batch ran out of memory during pre-allocation (a ``torch.OutOfMemoryError``)."""


@dataclass
class PreallocationReport:
    """What the pre-allocation pass did (``CachePreallocator.report``); sizes in bytes, ``None`` where not measured."""

    shapes: list[tuple[int, int]]
    keys: tuple[str, ...]
    device: str
    seconds: float = 0.0
    peak_allocated: int | None = None  # CUDA: peak of live tensors during the pass
    reserved: int | None = None  # CUDA: cached by the allocator after the pass
    rss_before: int | None = None  # CPU: resident set size before the pass
    peak_rss: int | None = None  # CPU: process peak RSS after the pass
    passes: list[str] = field(default_factory=list)  # "fit_start", and "train_start" when re-reserved
    layouts: list[Layout] = field(default_factory=list)  # document lengths per row of each shape's batch
    optimizer_state: int | None = None  # bytes of optimizer state reserved; None: an optimizer we do not know

    def summary(self) -> str:
        shapes = ", ".join(f"{r}x{l}" for r, l in self.shapes)
        state = (
            "optimizer state not reserved (unknown optimizer)"
            if self.optimizer_state is None
            else f"optimizer state {stats.format_bytes(self.optimizer_state)}"
        )
        if self.device.startswith("cuda"):
            sizes = (
                f"peak allocated {stats.format_bytes(self.peak_allocated)}, "
                f"reserved {stats.format_bytes(self.reserved)}"
            )
        else:
            sizes = (
                f"RSS {stats.format_bytes(self.rss_before)} before, process peak {stats.format_bytes(self.peak_rss)}"
            )
        return (
            f"CachePreallocator: worst-case batch {shapes} (rows x length; {', '.join(self.keys)}) fits on "
            f"{self.device} with {state}: {sizes} ({self.seconds:.1f}s)."
        )
