"""StepProgressBar: one bar over optimizer steps, out of max_steps or what max_epochs amounts to."""

import lightning.pytorch as L
import pytest
from lightning.pytorch import Callback
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_seqmem.training.progress import StepProgressBar


class BarState(Callback):
    """(n, total) of the training bar after every batch."""

    def __init__(self, bar):
        self.bar, self.seen = bar, []

    def on_train_batch_end(self, trainer, *args):
        self.seen.append((self.bar.train_progress_bar.n, self.bar.train_progress_bar.total))


@pytest.mark.parametrize(
    "kwargs,total",
    [
        (dict(max_steps=7), 7),  # bounded by steps, across 3 epochs of 3 batches
        (dict(max_epochs=2), 6),  # bounded by epochs
        (dict(max_steps=4, accumulate_grad_batches=2, max_epochs=-1), 4),  # steps, not batches
    ],
)
def test_bar_counts_optimizer_steps(tmp_path, kwargs, total):
    bar = StepProgressBar()
    state = BarState(bar)
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_train_batches=3,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        callbacks=[bar, state],
        **kwargs,
    )
    trainer.fit(BoringModel())
    assert {t for _, t in state.seen} == {total}  # one total for the whole run, never reset per epoch
    assert [n for n, _ in state.seen] == sorted(n for n, _ in state.seen)
    assert state.seen[-1][0] == trainer.global_step == total
