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
    bar = StepProgressBar(interactive=True)
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


def test_plain_lines_when_not_a_terminal(tmp_path, caplog):
    """Output to a file or pipe: no bar, a line every ``line_every_n_steps`` steps and at the last one, one per
    validation; what each line says comes from the pure functions below."""
    import logging

    bar = StepProgressBar(line_every_n_steps=3)  # pytest captures stdout: not a terminal
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        max_steps=7,
        limit_train_batches=4,
        limit_val_batches=2,
        val_check_interval=4,
        default_root_dir=tmp_path,
        callbacks=[bar],
    )
    with caplog.at_level(logging.INFO):
        trainer.fit(BoringModel())
    lines = [r.getMessage() for r in caplog.records]
    steps = [line.split(",")[0] for line in lines if line.startswith("step ")]
    assert steps == ["step 3/7 (43%)", "step 6/7 (86%)", "step 7/7 (100%)"]
    assert len([line for line in lines if line.startswith("validation at step 4: 2 batches in ")]) == 1


def test_line_schedule_and_text():
    from lightning_seqmem.training.progress import line_due, progress_line

    assert not line_due(5, 100, last_step=5, seconds_since=999, every_steps=1, every_s=1)  # never twice a step
    assert line_due(7, 100, 2, 0.0, 5, 60) and not line_due(6, 100, 2, 0.0, 5, 60)
    assert line_due(6, 100, 2, 61.0, 5, 60) and line_due(100, 100, 99, 0.0, 50, 60)  # time; the last step
    text = progress_line(50, 200, 1, elapsed=100.0, done=40, metrics={"train/loss": 2.345678, "v_num": 3})
    assert text == "step 50/200 (25%), epoch 1, 2.5 s/step, elapsed 0:01:40, left 0:06:15, train/loss=2.346"
    assert progress_line(3, None, 0, 1.0, 0, {}) == "step 3, epoch 0"
    with pytest.raises(ValueError, match="line_every_n_steps must be an int >= 1"):
        StepProgressBar(line_every_n_steps=0)
