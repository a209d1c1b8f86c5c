"""Memory monitor: allocator statistics every N steps, a summary at the end of fit, a snapshot on OOM."""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_seqmem.memory import stats
from lightning_seqmem.memory.allocator import expandable_segments_on
from lightning_seqmem.protocols import SurvivesOom


def _is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _cuda_stats(device: torch.device) -> dict[str, Any]:
    return torch.cuda.memory_stats(device)


def _training_device(trainer: Trainer) -> torch.device:
    """The device the run trains on. Not ``pl_module.device``: Lightning moves the module back to the CPU before
    ``on_fit_end``."""
    return trainer.strategy.root_device


class MemoryMonitor(Callback):
    """Log memory every ``every_n_steps`` optimizer steps (and after the first), summarise at the end of fit.

    On CUDA it logs, from ``torch.cuda.memory_stats()`` of the device the run trains on: ``memory/allocated_gib``,
    ``reserved_gib``, ``peak_allocated_gib``, ``peak_reserved_gib``, ``inactive_split_gib`` and its peak,
    ``fragmentation`` (the peak of inactive split blocks, which the allocator cannot merge for a larger request,
    over the peak reserved: :func:`~lightning_seqmem.memory.stats.stranded_share`), ``num_alloc_retries``,
    ``num_ooms`` and ``num_device_alloc`` (cudaMalloc calls). On CPU it logs the process's
    ``rss_gib`` and ``peak_rss_gib``. Values go to every logger with ``log_metrics`` (``self.log`` would be averaged
    or dropped by Lightning's logging cadence) and to :attr:`history`.

    A model that survives out-of-memory micro-batches (``CausalLM(on_oom="split")``, ``protocols.SurvivesOom``) has
    each failure recorded in :attr:`oom_events` (``stage``, ``step``, ``tokens``, and ``allocated``/``reserved`` bytes
    on CUDA at the time), logged as ``memory/oom_splits`` and counted in the summary.

    At the end of fit :attr:`summary` holds the peaks, the reserved-memory growth after the first step, the retries
    and the largest fragmentation seen; a warning with the fixes the run does not have yet (expandable segments,
    ``CachePreallocator``) follows when retries happened or fragmentation exceeded ``fragmentation_threshold``.

    Args:
        every_n_steps: log every this many optimizer steps (``trainer.global_step``).
        fragmentation_threshold: warn at the end when fragmentation went above this share.
        record_history: CUDA only: record allocator history (``torch.cuda.memory._record_memory_history``) so a
            snapshot shows where every block came from. Costs some speed.
        snapshot_dir: CUDA only: on an OOM, dump a snapshot there for https://pytorch.org/memory_viz.
        max_history_entries: allocator events kept when ``record_history`` is on.

    Raises:
        ValueError: if ``every_n_steps`` < 1 or ``fragmentation_threshold`` is not in [0, 1].

    Example::

        Trainer(callbacks=[MemoryMonitor(every_n_steps=50, snapshot_dir="oom_snapshots")])
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        fragmentation_threshold: float = 0.2,
        record_history: bool = False,
        snapshot_dir: str | None = None,
        max_history_entries: int = 100_000,
    ) -> None:
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an int >= 1, got {every_n_steps!r}.")
        if not 0.0 <= fragmentation_threshold <= 1.0:
            raise ValueError(f"fragmentation_threshold must be in [0, 1], got {fragmentation_threshold!r}.")
        self.every_n_steps = every_n_steps
        self.fragmentation_threshold = fragmentation_threshold
        self.record_history = record_history
        self.snapshot_dir = snapshot_dir
        self.max_history_entries = max_history_entries
        self.history: list[dict[str, float]] = []
        self.oom_events: list[dict[str, Any]] = []
        self.summary: dict[str, float] = {}
        self.snapshot_path: str | None = None
        self._recording = False

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.history, self.summary, self.oom_events = [], {}, []
        on_cuda = _is_cuda(_training_device(trainer))
        if (self.record_history or self.snapshot_dir) and not on_cuda:
            rank_zero_warn("MemoryMonitor: record_history and snapshot_dir need CUDA; ignored on this device.")
        elif self.record_history:
            torch.cuda.memory._record_memory_history(max_entries=self.max_history_entries)
            self._recording = True

    def collect(self, device: torch.device) -> dict[str, float]:
        """Current memory metrics for ``device`` (CUDA allocator statistics, else the process's RSS)."""
        return stats.cuda_memory_metrics(_cuda_stats(device)) if _is_cuda(device) else stats.cpu_memory_metrics()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._take_oom_events(trainer, pl_module)
        step = trainer.global_step
        if step == 0 or (self.history and self.history[-1]["step"] == step):
            return  # no optimizer step yet, or still accumulating the same step
        if step != 1 and step % self.every_n_steps != 0:
            return
        metrics = self.collect(_training_device(trainer))
        self.history.append({"step": step, **metrics})
        logged = {f"memory/{name}": value for name, value in metrics.items()}
        for logger in trainer.loggers:
            logger.log_metrics(logged, step=step)

    @override
    def on_validation_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int, *args: Any
    ) -> None:
        self._take_oom_events(trainer, pl_module)

    def _take_oom_events(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Record the model's out-of-memory events since the last batch (a list the model only appends to)."""
        if not isinstance(pl_module, SurvivesOom):
            return
        new = pl_module.oom_events[len(self.oom_events) :]
        if not new:
            return
        self.oom_events.extend(new)
        for logger in trainer.loggers:
            logger.log_metrics({"memory/oom_splits": float(len(self.oom_events))}, step=trainer.global_step)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._take_oom_events(trainer, pl_module)
        if not self.history or self.history[-1]["step"] != trainer.global_step:
            self.history.append({"step": trainer.global_step, **self.collect(_training_device(trainer))})
        first, last = self.history[0], self.history[-1]
        summary = {"steps": float(last["step"])}
        for name in (
            "peak_allocated_gib",
            "peak_reserved_gib",
            "peak_rss_gib",
            "num_alloc_retries",
            "num_ooms",
            "num_device_alloc",
        ):
            if name in last:
                summary[name] = last[name]
        if "reserved_gib" in first:
            summary["reserved_after_first_step_gib"] = first["reserved_gib"]
            reserved = [row["reserved_gib"] for row in self.history if "reserved_gib" in row]
            summary["reserved_growth_gib"] = max(reserved) - first["reserved_gib"]
            summary["max_fragmentation"] = max(row.get("fragmentation", 0.0) for row in self.history)
        if self.oom_events:
            summary["oom_splits"] = float(len(self.oom_events))
        self.summary = summary
        rank_zero_info("MemoryMonitor summary: " + ", ".join(f"{k}={v:.3g}" for k, v in summary.items()))
        from lightning_seqmem.memory.preallocate import CachePreallocator

        advice = stats.memory_advice(
            summary.get("num_alloc_retries", 0.0),
            summary.get("max_fragmentation", 0.0),
            self.fragmentation_threshold,
            preallocating=any(isinstance(cb, CachePreallocator) for cb in trainer.callbacks),
            expandable=expandable_segments_on(),
        )
        if advice:
            rank_zero_warn(advice)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if not (self.snapshot_dir and isinstance(exception, torch.OutOfMemoryError)):
            return
        if not _is_cuda(_training_device(trainer)):
            return
        os.makedirs(self.snapshot_dir, exist_ok=True)
        self.snapshot_path = os.path.join(self.snapshot_dir, f"oom_rank{trainer.global_rank}.pickle")
        torch.cuda.memory._dump_snapshot(self.snapshot_path)
        rank_zero_warn(
            f"Out of memory: allocator snapshot written to {self.snapshot_path}; drag it onto "
            "https://pytorch.org/memory_viz to see which tensors held the memory"
            + ("." if self._recording else " (MemoryMonitor(record_history=True) adds where each block came from).")
        )

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording = False
