"""Run by test_memory_preallocate.py in a subprocess: CachePreallocator under DDP on CPU (gloo).

Usage: python _memory_ddp_script.py DEVICES OUT_DIR [--no-prealloc]
Each rank checks the pass left its state bit-identical and saves its final parameters to OUT_DIR/rank{N}.pt.
"""

import sys

import lightning.pytorch as L
import torch
from _memory_helpers import Probe, TinyData, TinyLM, assert_same
from torch.nn.parallel import DistributedDataParallel

from lightning_seqmem.memory import CachePreallocator


class WrappedProbe(Probe):
    def on_fit_start(self, trainer, pl_module):
        super().on_fit_start(trainer, pl_module)
        assert isinstance(trainer.strategy.model, DistributedDataParallel)


def main(devices: int, out: str, prealloc: bool) -> None:
    L.seed_everything(0)
    model, before, after = TinyLM(), WrappedProbe(), Probe()
    callbacks = [before, CachePreallocator(), after] if prealloc else []
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=devices,
        strategy="ddp",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    trainer.fit(model, datamodule=TinyData())
    if prealloc:
        assert_same(before.state, after.state)
        assert model.seen[0]["shape"] == (2, 48)
    torch.save({n: p.detach() for n, p in model.named_parameters()}, f"{out}/rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], "--no-prealloc" not in sys.argv)
