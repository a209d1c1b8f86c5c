"""Step Progress Bar
=================

``StepProgressBar`` is Lightning's tqdm bar counting optimizer steps out of the run's total (``max_steps``, or
what ``max_epochs`` amounts to), in one bar across epochs: a job bounded by ``max_steps`` shows ``57/150``, not
``Epoch 0/-2`` with batches of an epoch it will never finish.

When standard output is not a terminal (SLURM, ``nohup``, CI, ``| tee``) a bar would fill the log with carriage
returns and cursor codes: the bars are off and progress arrives as plain log lines instead, as transformers' Trainer
prints its logs when tqdm is off — one every ``line_every_n_steps`` optimizer steps or ``line_every_seconds``,
whichever comes first, and one per validation.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

__all__ = ["StepProgressBar", "line_due", "progress_line"]


def line_due(step: int, total: int | None, last_step: int, seconds_since: float, every_steps: int, every_s: float):
    """Whether a plain progress line is due at optimizer step ``step``: the last step, ``every_steps`` steps or
    ``every_s`` seconds after the last line (and never twice for one step)."""
    if step <= last_step:
        return False
    return step == total or step - last_step >= every_steps or seconds_since >= every_s


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _value(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def progress_line(step: int, total: int | None, epoch: int, elapsed: float, done: int, metrics: dict) -> str:
    """One line of training progress: ``step 20/150 (13%), epoch 0, 0.52 s/step, elapsed 0:00:10, left 0:01:08,
    loss=3.412``; ``done``: steps taken in this run (a resumed run starts later), for the rate."""
    parts = [f"step {step}/{total} ({step / total:.0%})" if total else f"step {step}", f"epoch {epoch}"]
    if done > 0:
        rate = elapsed / done
        parts.append(f"{rate:.3g} s/step, elapsed {_clock(elapsed)}")
        if total:
            parts[-1] += f", left {_clock(rate * max(total - step, 0))}"
    parts += [f"{k}={_value(v)}" for k, v in metrics.items() if k != "v_num"]
    return ", ".join(parts)


class StepProgressBar(TQDMProgressBar):
    """A tqdm progress bar over optimizer steps (``trainer.global_step`` of ``trainer.estimated_stepping_batches``).

    Validation keeps Lightning's own bar. With ``trainer.enable_progress_bar=false`` leave it out (Lightning refuses
    a progress-bar callback then; ``seqmem-train`` drops it for you).

    Args:
        refresh_rate: redraw every N optimizer steps.
        process_position: the bar's line, for several processes writing to one terminal.
        interactive: draw bars; ``False``: plain lines (:func:`progress_line`); ``None``: bars when standard
            output is a terminal.
        line_every_n_steps: without bars, a line every N optimizer steps; ``None``: every 5 % of the run.
        line_every_seconds: without bars, a line at least this often while training.

    Example::

        Trainer(max_steps=500, callbacks=[StepProgressBar()])  # "Training (epoch 0): 12%| 60/500 ..."
    """

    def __init__(
        self,
        refresh_rate: int = 1,
        process_position: int = 0,
        interactive: bool | None = None,
        line_every_n_steps: int | None = None,
        line_every_seconds: float = 60.0,
    ) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=False)
        if line_every_n_steps is not None and line_every_n_steps < 1:
            raise ValueError(f"line_every_n_steps must be an int >= 1 or None, got {line_every_n_steps!r}.")
        if line_every_seconds <= 0:
            raise ValueError(f"line_every_seconds must be > 0, got {line_every_seconds!r}.")
        self.interactive = interactive
        self.line_every_n_steps, self.line_every_seconds = line_every_n_steps, line_every_seconds
        self._lines = False
        self._start = self._last_time = self._val_start = 0.0
        self._first_step = self._last_step = 0

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        interactive = sys.stdout.isatty() if self.interactive is None else self.interactive
        self._lines = not interactive and trainer.is_global_zero
        if not interactive:
            self.disable()  # every bar silent; the lines below say it instead

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._start = self._last_time = time.monotonic()
        self._first_step = self._last_step = trainer.global_step
        bar = self.train_progress_bar
        bar.reset(total=convert_inf(trainer.estimated_stepping_batches))
        bar.n = trainer.global_step  # a resumed run starts where it was
        bar.set_description("Training")

    @override
    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        # One bar for the whole run: no reset per epoch.
        self.train_progress_bar.set_description(f"Training (epoch {trainer.current_epoch})")

    def _line(self, trainer: Trainer, pl_module: LightningModule) -> None:
        step, total = trainer.global_step, convert_inf(trainer.estimated_stepping_batches)
        every = self.line_every_n_steps or max(1, (total or 100) // 20)
        now = time.monotonic()
        if line_due(step, total, self._last_step, now - self._last_time, every, self.line_every_seconds):
            metrics = self.get_metrics(trainer, pl_module)
            done = step - self._first_step
            rank_zero_info(progress_line(step, total, trainer.current_epoch, now - self._start, done, metrics))
            self._last_step, self._last_time = step, now

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_start(trainer, pl_module)
        self._val_start = time.monotonic()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self._lines and not trainer.sanity_checking:
            metrics = {
                k: v.item() for k, v in trainer.callback_metrics.items() if k.startswith("val") and v.numel() == 1
            }
            batches = sum(convert_inf(n) or 0 for n in trainer.num_val_batches)
            values = "".join(f", {k}={_value(v)}" for k, v in metrics.items())
            took = time.monotonic() - self._val_start
            rank_zero_info(f"validation at step {trainer.global_step}: {batches} batches in {took:.1f} s{values}")

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._lines:
            self._line(trainer, pl_module)
        bar = self.train_progress_bar
        step = trainer.global_step
        if bar is not None and step != bar.n and self._should_update(step, bar.total):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            bar.refresh()

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))
