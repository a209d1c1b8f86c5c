"""Example 1: your own LightningModule and Trainer, with our DataModule and callbacks. Plain Python, no Hydra.

python examples/own_trainer.py --max-steps 100
"""

import argparse

from lightning_seqmem.memory import configure_allocator

configure_allocator()  # before torch is imported: the CUDA allocator reads its settings once

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from lightning_seqmem import SeqLengthWarmup, SeqMemDataModule  # noqa: E402
from lightning_seqmem.apps.summary import RunSummary  # noqa: E402
from lightning_seqmem.memory import CachePreallocator, MemoryMonitor  # noqa: E402


class MyLM(L.LightningModule):
    """Any module that takes our batch dicts: ``input_ids``/``labels`` ``[batch, seq]`` plus ``position_ids``
    (packed) or ``attention_mask`` (padded)."""

    def __init__(self, vocab_size: int, lr: float = 2e-3) -> None:
        super().__init__()
        self.model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_embd=128, n_layer=2, n_head=4))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch, use_cache=False).loss
        # Warmup may change the number of rows after Lightning read it: say the batch size.
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.model(**batch, use_cache=False).loss, batch_size=batch["input_ids"].shape[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--out", default="outputs/own_trainer")
    args = parser.parse_args()

    dm = SeqMemDataModule(max_length=args.max_length, micro_batch_size=8, strategy="pack")  # built-in corpus
    callbacks = [
        SeqLengthWarmup(duration=0.3, max_seq_length=args.max_length),
        CachePreallocator(),
        MemoryMonitor(every_n_steps=25),
        RunSummary(),
    ]
    trainer = L.Trainer(
        max_steps=args.max_steps,
        val_check_interval=max(1, args.max_steps // 2),
        limit_val_batches=4,
        callbacks=callbacks,
        default_root_dir=args.out,
        enable_checkpointing=False,
    )
    trainer.fit(MyLM(vocab_size=len(dm.tokenizer)), datamodule=dm)
