"""Peak live tensor bytes per named range of a run, from torch.profiler (as ``measured.measured_peak_bytes``).

The profiler records every allocation and free of torch's allocators; the running sum of their sizes is the live
tensor bytes since profiling started (build everything inside the profile so weights count). A range is a
``record_function`` (``CachePreallocator`` opens one around its pass; :class:`StepRanges` one per training step).
"""

from __future__ import annotations

import lightning.pytorch as L
import numpy as np
from torch.profiler import record_function

from lightning_seqmem.memory.measured import profiled_allocations, profiled_events


class StepRanges(L.Callback):
    """A profiler range ``train_step`` around every training batch (forward, backward, optimizer step)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._range = record_function("train_step")
        self._range.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._range.__exit__(None, None, None)


def range_peaks(prof, names: tuple[str, ...] = ("CachePreallocator", "train_step")) -> dict[str, list[int]]:
    """For each range name, the peak live bytes inside each of its ranges, in time order."""
    allocations = profiled_allocations(prof)
    spans = {name: [] for name in names}
    for event in profiled_events(prof):
        if event.name in spans:
            spans[event.name].append((event.start_time_ns, event.end_time_ns))
    times = np.array([t for t, _ in allocations], dtype=np.int64)
    live = np.cumsum([size for _, size in allocations])
    peaks = {}
    for name, ranges in spans.items():
        peaks[name] = []
        for start, end in sorted(ranges):
            lo, hi = np.searchsorted(times, start), np.searchsorted(times, end, side="right")
            before = int(live[lo - 1]) if lo else 0
            peaks[name].append(int(max(before, live[lo:hi].max(initial=before))))
    return peaks
