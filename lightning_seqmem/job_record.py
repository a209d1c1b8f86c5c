"""Job Record
==========

``JobRecord`` appends one row per validation to ``<run dir>/progress.csv``: optimizer step, training wall-clock,
real tokens trained on and validation loss. That is all ``seqmem-report`` needs to compare the jobs of a sweep by
time and by tokens, whatever the sweep varied.
"""

from __future__ import annotations

import csv
import os
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from typing_extensions import override

from lightning_seqmem.batch import count_real_tokens
from lightning_seqmem.protocols import find_pad_token_id

__all__ = ["FIELDS", "JobRecord"]

FIELDS = ("step", "wall_clock_s", "elapsed_s", "cpu_s", "tokens_seen", "val_loss")


class JobRecord(Callback):
    """Record validation loss against training wall-clock and real tokens seen, one CSV row per validation.

    ``wall_clock_s`` is time spent training since ``on_train_start`` with validation time left out (validation is
    measurement, the same cost for every job); ``elapsed_s`` includes it. ``cpu_s`` is the process's CPU time
    over the same span (all threads), a steadier clock than wall-clock on a shared machine. ``tokens_seen`` counts the real (non-pad)
    tokens of the batches the model trained on, after any in-place cut by ``SeqLengthWarmup``, summed over ranks.

    Args:
        path: the CSV file; default ``<trainer.default_root_dir>/progress.csv``.
        monitor: the logged validation metric to record.

    Example::

        Trainer(callbacks=[SeqLengthWarmup(duration=0.3), JobRecord()], val_check_interval=25)
    """

    def __init__(self, path: str | None = None, monitor: str = "val/loss") -> None:
        super().__init__()
        self.path = path
        self.monitor = monitor
        self._tokens = 0
        self._start = 0.0
        self._val_time = 0.0
        self._val_start: float | None = None
        self._cpu_start = 0.0
        self._val_cpu = 0.0
        self._val_cpu_start = 0.0
        self._pad_token_id: int | None = None
        self._warned = False

    def _file(self, trainer: Trainer) -> str:
        return self.path or os.path.join(trainer.default_root_dir, "progress.csv")

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pad_token_id = find_pad_token_id(trainer.datamodule, pl_module, pl_module.hparams)
        self._start = time.perf_counter()
        self._val_time = 0.0
        self._cpu_start = time.process_time()
        self._val_cpu = 0.0
        if trainer.global_step == 0:
            self._reset_file(trainer)

    @rank_zero_only
    def _reset_file(self, trainer: Trainer) -> None:
        path = self._file(trainer)
        if os.path.exists(path):
            os.remove(path)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # The batch is the dict training_step saw (warmup cuts it in place), so this counts what was trained on.
        if not isinstance(batch, dict) or "input_ids" not in batch:
            return
        self._tokens += int(count_real_tokens(batch, self._pad_token_id))

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._val_start = time.perf_counter()
            self._val_cpu_start = time.process_time()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or self._val_start is None:
            return
        now = time.perf_counter()
        self._val_time += now - self._val_start
        cpu_now = time.process_time()
        self._val_cpu += cpu_now - self._val_cpu_start
        self._val_start = None
        # Every rank validates, so this all-reduce is matched on all of them.
        tokens = trainer.strategy.reduce(torch.tensor(float(self._tokens), device=pl_module.device), reduce_op="sum")
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            if not self._warned:
                self._warned = True
                rank_zero_warn(f"JobRecord: no logged metric {self.monitor!r}; logged: {sorted(trainer.callback_metrics)}.")
            return
        elapsed = now - self._start
        self._append(trainer, {
            "step": trainer.global_step,
            "wall_clock_s": round(elapsed - self._val_time, 4),
            "elapsed_s": round(elapsed, 4),
            "cpu_s": round(cpu_now - self._cpu_start - self._val_cpu, 4),
            "tokens_seen": int(tokens.item()),
            "val_loss": float(value),
        })

    @rank_zero_only
    def _append(self, trainer: Trainer, row: dict[str, Any]) -> None:
        path = self._file(trainer)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        new = not os.path.exists(path)
        with open(path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            if new:
                writer.writeheader()
            writer.writerow(row)
