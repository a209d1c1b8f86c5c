"""A checkpoint saved by hand in ``on_train_epoch_end`` resumes at the next epoch's first batch: Lightning's own
semantics (its ``ModelCheckpoint(save_on_train_epoch_end=True)`` file holds the same loop state and resumes the same
way), and the DataModule's loader follows it: the resumed run trains exactly the uninterrupted run's next epoch."""

import lightning.pytorch as L
import torch
from _recorder import Recorder

from lightning_seqmem import SeqMemDataModule


class SaveAtFirstEpochEnd(L.Callback):
    """What a user writes: ``trainer.save_checkpoint`` at the end of the first epoch."""

    def __init__(self, path):
        self.path = path

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


def _fit(root, dataset, callbacks=(), ckpt=None):
    dm = SeqMemDataModule(dataset, max_length=32, micro_batch_size=8, strategy="pack")
    model = Recorder()
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=list(callbacks),
        enable_checkpointing=any(isinstance(c, L.callbacks.ModelCheckpoint) for c in callbacks),
        default_root_dir=root,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
    return model.seen, trainer


def test_a_checkpoint_saved_at_epoch_end_resumes_into_the_next_epoch_as_lightnings_own(small_text_dataset, tmp_path):
    hand = tmp_path / "hand.ckpt"
    own = L.callbacks.ModelCheckpoint(dirpath=tmp_path / "own", save_on_train_epoch_end=True, save_top_k=-1)
    full, trainer = _fit(tmp_path, small_text_dataset, [SaveAtFirstEpochEnd(hand), own])
    per_epoch = trainer.global_step // 2
    assert per_epoch > 1 and len(full) == 2 * per_epoch
    lightning_file = tmp_path / "own" / f"epoch=0-step={per_epoch}.ckpt"
    saved = [torch.load(path, weights_only=False) for path in (hand, lightning_file)]
    assert saved[0]["loops"]["fit_loop"] == saved[1]["loops"]["fit_loop"]  # the same loop state as Lightning's file
    assert saved[0]["epoch"] == 0 and saved[0]["global_step"] == per_epoch
    for path in (hand, lightning_file):
        resumed, again = _fit(tmp_path / "resumed", small_text_dataset, ckpt=str(path))
        assert resumed == full[per_epoch:]  # epoch 1 from its first batch: epoch 0 is not trained again
        assert again.global_step == 2 * per_epoch and again.current_epoch == 2
