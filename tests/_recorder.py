"""A LightningModule that only records the batches it trains on, and a fit helper for resume tests."""

import lightning.pytorch as L
import torch

from lightning_seqmem import SeqMemDataModule


class Recorder(L.LightningModule):
    """A one-parameter model: enough for Lightning to run steps and checkpoint, and it records what it saw."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"].tolist())
        return (self.w * batch["input_ids"].float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit_recording(tmp_path, max_steps, ckpt=None, save=False, **data):
    """Fit a ``Recorder`` on a ``SeqMemDataModule(**data)`` (packed, 32 tokens, 8 rows unless given); with
    ``save``, checkpoint every 3 steps into ``tmp_path``. Returns ``(batches seen, datamodule)``."""
    dm = SeqMemDataModule(**{"max_length": 32, "micro_batch_size": 8, "strategy": "pack", **data})
    model = Recorder()
    callbacks = [L.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)] if save else []
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
        enable_checkpointing=save,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
    return model.seen, dm
