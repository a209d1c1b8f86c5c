"""Job Record
==========

``JobRecord`` appends one row per validation to ``<run dir>/progress.csv`` (the run folder: ``run_files``):
optimizer step, training wall-clock, real tokens trained on and validation loss. That is all ``seqmem-report``
needs to compare the jobs of a sweep by time and by tokens, whatever the sweep varied. The training loss goes, on
the same clocks, to ``<run dir>/train_progress.csv`` (one row every ``train_every_n_steps`` optimizer steps).
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

from lightning_seqmem.apps.run_files import (
    PROGRESS_FIELDS,
    PROGRESS_FILE,
    SOURCE_PROGRESS_FIELDS,
    SOURCE_PROGRESS_FILE,
    TRAIN_PROGRESS_FIELDS,
    TRAIN_PROGRESS_FILE,
)
from lightning_seqmem.batch import count_real_tokens
from lightning_seqmem.protocols import find_pad_token_id

__all__ = ["JobRecord"]

# The figures a run carries through its checkpoints (whole run: all its processes, validation time left out).
_NOTHING_BEFORE = {"tokens_seen": 0, "wall_clock_s": 0.0, "cpu_s": 0.0, "elapsed_s": 0.0}


class JobRecord(Callback):
    """Record validation loss against training wall-clock and real tokens seen, one CSV row per validation.

    ``wall_clock_s`` is time spent training since ``on_train_start`` with validation time left out (validation is
    measurement, the same cost for every job); ``elapsed_s`` includes it. ``cpu_s`` is the process's CPU time
    over the same span (all threads), a steadier clock than wall-clock on a shared machine. ``tokens_seen`` counts the
    real (non-pad) tokens of the batches the model trained on, after any in-place cut by ``SeqLengthWarmup``, summed
    over ranks.

    The figures are the whole run's: a run resumed from a checkpoint goes on from the tokens and clocks it saved
    (``state_dict``), and resumed into the same folder it drops the rows written after that checkpoint first.

    ``train_progress.csv`` (next to ``path``) holds the mean of the logged ``train_monitor`` over the micro-batches
    since its previous row (rank 0's), with the same clocks and the same token count.

    Args:
        path: the CSV file; default ``<trainer.default_root_dir>/progress.csv``.
        monitor: the logged validation metric to record.
        train_monitor: the logged training metric to record in ``train_progress.csv``.
        train_every_n_steps: a training row every N optimizer steps; None = ``trainer.log_every_n_steps``; 0 = none.

    Example::

        Trainer(callbacks=[SeqLengthWarmup(duration=0.3), JobRecord()], val_check_interval=25)
    """

    def __init__(
        self,
        path: str | None = None,
        monitor: str = "val/loss",
        train_monitor: str = "train/loss",
        train_every_n_steps: int | None = None,
    ) -> None:
        super().__init__()
        if train_every_n_steps is not None and (not isinstance(train_every_n_steps, int) or train_every_n_steps < 0):
            raise ValueError(
                f"train_every_n_steps must be an int >= 0 (0 = no training rows) or None, got {train_every_n_steps!r}."
            )
        self.path = path
        self.monitor = monitor
        self.train_monitor = train_monitor
        self.train_every_n_steps = train_every_n_steps
        self._train_sum = 0.0
        self._train_count = 0
        self._train_recorded_step = -1
        self._tokens = 0
        self._start = 0.0
        self._val_time = 0.0
        self._val_start: float | None = None
        self._cpu_start = 0.0
        self._val_cpu = 0.0
        self._val_cpu_start = 0.0
        self._pad_token_id: int | None = None
        self._warned = False
        self._before: dict[str, float] = dict(_NOTHING_BEFORE)  # the run's figures up to the checkpoint resumed
        self._trainer: Trainer | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer

    @override
    def state_dict(self) -> dict[str, Any]:
        """The whole run's figures at the checkpoint, so that a resumed run's rows go on from them (every rank
        builds a checkpoint together, so the sum over ranks in ``_progress`` is matched)."""
        trainer = self._trainer
        if trainer is None or trainer.lightning_module is None:
            return dict(self._before)
        now, cpu_now = time.perf_counter(), time.process_time()
        figures = self._progress(trainer, trainer.lightning_module, now, cpu_now)
        return {**figures, "elapsed_s": self._before["elapsed_s"] + now - self._start}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._before = {k: state_dict.get(k, v) for k, v in _NOTHING_BEFORE.items()}

    def _file(self, trainer: Trainer) -> str:
        return self.path or os.path.join(trainer.default_root_dir, PROGRESS_FILE)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pad_token_id = find_pad_token_id(trainer.datamodule, pl_module, pl_module.hparams)
        self._start = time.perf_counter()
        self._val_time = 0.0
        self._cpu_start = time.process_time()
        self._val_cpu = 0.0
        self._train_sum, self._train_count, self._train_recorded_step = 0.0, 0, trainer.global_step
        if trainer.global_step == 0:
            self._reset_file(trainer)
        else:  # resumed: rows past the checkpoint were trained again from it, and are written again
            self._cut_files(trainer, trainer.global_step)

    def _train_file(self, trainer: Trainer) -> str:
        return os.path.join(os.path.dirname(self._file(trainer)) or ".", TRAIN_PROGRESS_FILE)

    @rank_zero_only
    def _reset_file(self, trainer: Trainer) -> None:
        source_file = os.path.join(os.path.dirname(self._file(trainer)) or ".", SOURCE_PROGRESS_FILE)
        for path in (self._file(trainer), self._train_file(trainer), source_file):
            if os.path.exists(path):
                os.remove(path)

    @rank_zero_only
    def _cut_files(self, trainer: Trainer, step: int) -> None:
        """Drop the rows a stopped process wrote after the checkpoint it resumes from, so each file's steps, tokens
        and clocks only go up."""
        source_file = os.path.join(os.path.dirname(self._file(trainer)) or ".", SOURCE_PROGRESS_FILE)
        for path in (self._train_file(trainer), self._file(trainer), source_file):
            _keep_rows(path, step)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # The batch is the dict training_step saw (warmup cuts it in place), so this counts what was trained on.
        if not isinstance(batch, dict) or "input_ids" not in batch:
            return
        self._tokens += int(count_real_tokens(batch, self._pad_token_id))

        self._record_train_loss(trainer, pl_module)

    def _record_train_loss(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Average the logged training loss per micro-batch; write a row every ``train_every_n_steps`` steps."""
        value = trainer.callback_metrics.get(self.train_monitor)
        if value is not None:
            self._train_sum += float(value)
            self._train_count += 1
        every = trainer.log_every_n_steps if self.train_every_n_steps is None else self.train_every_n_steps
        step = trainer.global_step
        if not every or step % every or step == self._train_recorded_step or not self._train_count:
            return
        # Every rank reaches this step together (global_step is shared), so the all-reduce in _progress is matched.
        now = time.perf_counter()
        self._append_train(
            trainer,
            {
                "step": step,
                **self._progress(trainer, pl_module, now, time.process_time()),
                "train_loss": self._train_sum / self._train_count,
            },
        )
        self._train_sum, self._train_count, self._train_recorded_step = 0.0, 0, step

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
        # Every rank validates, so the all-reduce in _progress is matched on all of them.
        progress = self._progress(trainer, pl_module, now, cpu_now)
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            if not self._warned:
                self._warned = True
                rank_zero_warn(
                    f"JobRecord: no logged metric {self.monitor!r}; logged: {sorted(trainer.callback_metrics)}."
                )
            return
        self._append(
            trainer,
            {
                "step": trainer.global_step,
                **progress,
                "elapsed_s": round(self._before["elapsed_s"] + now - self._start, 4),
                "val_loss": float(value),
            },
        )
        prefix = f"{self.monitor}/"  # a Mix's sources: val/loss/<name> (training.source_losses)
        for key in sorted(k for k in trainer.callback_metrics if k.startswith(prefix)):
            row = {"step": trainer.global_step, "source": key[len(prefix) :]}
            self._append_source(trainer, dict(row, val_loss=float(trainer.callback_metrics[key])))

    def _progress(self, trainer: Trainer, pl_module: LightningModule, now: float, cpu_now: float) -> dict[str, Any]:
        """Training wall-clock and CPU time (validation left out) and real tokens summed over ranks (an
        all-reduce: every rank must call it at the same point)."""
        tokens = trainer.strategy.reduce(torch.tensor(float(self._tokens), device=pl_module.device), reduce_op="sum")
        before = self._before
        return {
            "wall_clock_s": round(before["wall_clock_s"] + now - self._start - self._val_time, 4),
            "cpu_s": round(before["cpu_s"] + cpu_now - self._cpu_start - self._val_cpu, 4),
            "tokens_seen": int(before["tokens_seen"]) + int(tokens.item()),
        }

    @rank_zero_only
    def _append(self, trainer: Trainer, row: dict[str, Any]) -> None:
        _append_row(self._file(trainer), PROGRESS_FIELDS, row)

    @rank_zero_only
    def _append_source(self, trainer: Trainer, row: dict[str, Any]) -> None:
        path = os.path.join(os.path.dirname(self._file(trainer)) or ".", SOURCE_PROGRESS_FILE)
        _append_row(path, SOURCE_PROGRESS_FIELDS, row)

    @rank_zero_only
    def _append_train(self, trainer: Trainer, row: dict[str, Any]) -> None:
        _append_row(self._train_file(trainer), TRAIN_PROGRESS_FIELDS, row)


def _keep_rows(path: str, last_step: int) -> None:
    """Keep the rows of ``path`` up to ``last_step`` (rewritten in place; a missing file is left missing)."""
    if not os.path.exists(path):
        return
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        fields, rows = reader.fieldnames, [r for r in reader if int(r["step"]) <= last_step]
    with open(path + ".part", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields or [])
        writer.writeheader()
        writer.writerows(rows)
    os.replace(path + ".part", path)


def _append_row(path: str, fields: tuple[str, ...], row: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        if new:
            writer.writeheader()
        writer.writerow(row)
