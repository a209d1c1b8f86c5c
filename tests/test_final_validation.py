"""FinalValidation: one more validation at the last step, never two, for runs bounded by steps or by epochs."""

import lightning.pytorch as L
import pytest
from lightning.pytorch import Callback
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_seqmem.training.final_validation import FinalValidation


class LoggingModel(BoringModel):
    def validation_step(self, batch, batch_idx):
        loss = super().validation_step(batch, batch_idx)["x"]
        self.log("val_loss", loss)
        return loss


class ValidationSteps(Callback):
    """The optimizer step of every (non-sanity) validation, and the val loss logged at each."""

    def __init__(self):
        self.steps = []
        self.losses = []

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.steps.append(trainer.global_step)
            self.losses.append(float(trainer.callback_metrics["val_loss"]))


def fit(tmp_path, callbacks, **kwargs):
    seen = ValidationSteps()
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        callbacks=[*callbacks, seen],
        **{"limit_val_batches": 2, **kwargs},
    )
    trainer.fit(LoggingModel())
    return seen, trainer


@pytest.mark.parametrize(
    "kwargs,without,with_final",
    [
        (dict(max_steps=7, val_check_interval=3), [3, 6], [3, 6, 7]),  # bounded by steps
        (dict(max_steps=6, val_check_interval=3), [3, 6], [3, 6]),  # last step validated already
        (dict(max_steps=5, val_check_interval=50, limit_train_batches=50), [], [5]),  # no validation at all before
        (dict(max_epochs=2, limit_train_batches=5, val_check_interval=3), [3, 8], [3, 8, 10]),  # bounded by epochs
        (dict(max_epochs=2, limit_train_batches=5), [5, 10], [5, 10]),  # every epoch end validates
    ],
)
def test_validates_once_at_the_last_step(tmp_path, kwargs, without, with_final):
    assert fit(tmp_path, [], **kwargs)[0].steps == without
    seen, trainer = fit(tmp_path, [FinalValidation()], **kwargs)
    assert seen.steps == with_final
    assert trainer.global_step == with_final[-1]
    assert float(trainer.callback_metrics["val_loss"]) == seen.losses[-1]  # the final metric is the last step's


def test_no_validation_data_is_a_no_op(tmp_path):
    seen, trainer = fit(tmp_path, [FinalValidation()], max_steps=4, **{"limit_val_batches": 0})
    assert seen.steps == [] and trainer.global_step == 4
