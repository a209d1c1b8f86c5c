"""JobRecord's training rows: one every ``train_every_n_steps`` optimizer steps, none with 0, bad values refused."""

import csv

import lightning.pytorch as L
import pytest
import torch
from _recorder import Recorder

from lightning_seqmem import SeqMemDataModule
from lightning_seqmem.apps.job_record import JobRecord


class _LoggingRecorder(Recorder):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss)
        return loss


def _rows(tmp_path, small_text_dataset, every):
    dm = SeqMemDataModule(dataset=small_text_dataset, max_length=32, micro_batch_size=4, strategy="pack")
    trainer = L.Trainer(
        max_steps=6,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[JobRecord(path=str(tmp_path / "progress.csv"), train_every_n_steps=every)],
    )
    trainer.fit(_LoggingRecorder(), datamodule=dm)
    path = tmp_path / "train_progress.csv"
    return list(csv.DictReader(open(path))) if path.exists() else []


def test_training_rows_follow_train_every_n_steps(tmp_path, small_text_dataset):
    rows = _rows(tmp_path / "every2", small_text_dataset, 2)
    assert [int(r["step"]) for r in rows] == [2, 4, 6]
    tokens = [int(r["tokens_seen"]) for r in rows]
    assert tokens == sorted(tokens) and tokens[0] > 0  # real tokens so far, growing
    assert _rows(tmp_path / "none", small_text_dataset, 0) == []
    assert torch.isfinite(torch.tensor([float(r["train_loss"]) for r in rows])).all()


@pytest.mark.parametrize("bad", [-1, 1.5, "2"])
def test_bad_train_every_n_steps_is_refused(bad):
    with pytest.raises(ValueError, match="train_every_n_steps must be an int >= 0"):
        JobRecord(train_every_n_steps=bad)
