"""Final Validation
================

``FinalValidation`` validates once more when training ends, unless the last optimizer step was just validated, so
that every finished run has a validation loss at its last step whatever ``val_check_interval`` says (a sweep of
short jobs still has something to compare).
"""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

__all__ = ["FinalValidation"]


class FinalValidation(Callback):
    """Run the validation loop at the end of training when the last step was not validated.

    Works however training ends (``max_steps``, ``max_epochs``, ``max_time``, ``trainer.should_stop``); it does
    nothing when the last step already validated (no double validation) or when there is no validation data
    (``limit_val_batches=0``). Every rank runs it, so metrics synced across ranks stay matched. Callbacks that
    listen to validation (``JobRecord``, ``ModelCheckpoint``) see it like any other validation.

    Example::

        Trainer(max_steps=12, val_check_interval=50, callbacks=[FinalValidation()])  # validates at step 12
    """

    def __init__(self) -> None:
        super().__init__()
        self._validated_step: int | None = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._validated_step = None

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._validated_step = trainer.global_step

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._validated_step == trainer.global_step or trainer.global_step == 0 or not trainer.enable_validation:
            return
        # What the training epoch loop does for a scheduled validation (Lightning's on_advance_end).
        loop = trainer.fit_loop.epoch_loop
        trainer.validating = True
        connector = trainer._logger_connector
        first_loop_iter = connector._first_loop_iter
        try:
            loop.val_loop.run()
        finally:
            trainer.training = True
            connector._first_loop_iter = first_loop_iter
