"""Step Progress Bar
=================

``StepProgressBar`` is Lightning's tqdm bar counting optimizer steps out of the run's total (``max_steps``, or
what ``max_epochs`` amounts to), in one bar across epochs: a job bounded by ``max_steps`` shows ``57/150``, not
``Epoch 0/-2`` with batches of an epoch it will never finish.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf
from typing_extensions import override

__all__ = ["StepProgressBar"]


class StepProgressBar(TQDMProgressBar):
    """A tqdm progress bar over optimizer steps (``trainer.global_step`` of ``trainer.estimated_stepping_batches``).

    Validation keeps Lightning's own bar. With ``trainer.enable_progress_bar=false`` leave it out (Lightning refuses
    a progress-bar callback then; ``seqmem-train`` drops it for you).

    Args:
        refresh_rate: redraw every N optimizer steps.
        process_position: the bar's line, for several processes writing to one terminal.

    Example::

        Trainer(max_steps=500, callbacks=[StepProgressBar()])  # "Training (epoch 0): 12%| 60/500 ..."
    """

    def __init__(self, refresh_rate: int = 1, process_position: int = 0) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=False)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        bar = self.train_progress_bar
        bar.reset(total=convert_inf(trainer.estimated_stepping_batches))
        bar.n = trainer.global_step  # a resumed run starts where it was
        bar.set_description("Training")

    @override
    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        # One bar for the whole run: no reset per epoch.
        self.train_progress_bar.set_description(f"Training (epoch {trainer.current_epoch})")

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
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
