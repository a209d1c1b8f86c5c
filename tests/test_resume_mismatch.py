"""Resuming a mid-epoch checkpoint with other data: refused by default (naming what changed), or the epoch restarts."""

import lightning.pytorch as L
import pytest
import torch

from lightning_seqmem import SeqMemDataModule


class _Recorder(L.LightningModule):
    """One parameter, a zero learning rate: enough to run steps and checkpoint; it records the batches it saw."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"].tolist())
        return (self.w * batch["input_ids"].float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(tmp_path, max_steps, ckpt=None, save=False, **data):
    dm = SeqMemDataModule(**{"max_length": 32, "micro_batch_size": 8, "strategy": "pack", **data})
    model = _Recorder()
    callbacks = [L.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)] if save else []
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=callbacks,
                        enable_checkpointing=save, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
    return model.seen, dm


def test_resume_with_another_max_length_is_refused_naming_the_change(small_text_dataset, tmp_path):
    _fit(tmp_path, 3, save=True, dataset=small_text_dataset)
    ckpt = str(tmp_path / "epoch=0-step=3.ckpt")
    with pytest.raises(ValueError, match=r"max_length: 32 -> 16.*on_resume_mismatch='restart_epoch'"):
        _fit(tmp_path, 6, ckpt=ckpt, dataset=small_text_dataset, max_length=16)
    with pytest.raises(ValueError, match=r"strategy: 'pack' -> 'pad'"):
        _fit(tmp_path, 6, ckpt=ckpt, dataset=small_text_dataset, strategy="pad")
    other = small_text_dataset.select(range(1, len(small_text_dataset)))  # another dataset, same settings
    with pytest.raises(ValueError, match="Cannot resume the data position"):
        _fit(tmp_path, 6, ckpt=ckpt, dataset=other)


def test_resume_with_the_same_data_still_replays_exactly(small_text_dataset, tmp_path):
    full, _ = _fit(tmp_path / "full", 6, dataset=small_text_dataset)
    _fit(tmp_path, 3, save=True, dataset=small_text_dataset)
    resumed, _ = _fit(tmp_path, 6, ckpt=str(tmp_path / "epoch=0-step=3.ckpt"), dataset=small_text_dataset)
    assert resumed == full[3:]


def test_restart_epoch_starts_the_new_rows_from_their_first_batch(small_text_dataset, tmp_path):
    _fit(tmp_path, 3, save=True, dataset=small_text_dataset)
    fresh, dm = _fit(tmp_path / "fresh", 2, dataset=small_text_dataset, max_length=16)
    with pytest.warns(UserWarning, match="the current epoch restarts from its first batch"):
        resumed, _ = _fit(tmp_path, 5, ckpt=str(tmp_path / "epoch=0-step=3.ckpt"), dataset=small_text_dataset,
                          max_length=16, on_resume_mismatch="restart_epoch")
    assert resumed[:2] == fresh  # epoch 0 of the new rows from its start, not from the old position
    assert all(len(row) == 16 for batch in resumed for row in batch)


def test_on_resume_mismatch_is_validated():
    with pytest.raises(ValueError, match="on_resume_mismatch='skip' is not valid"):
        SeqMemDataModule(on_resume_mismatch="skip")
