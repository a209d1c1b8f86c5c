"""Run by test_memory_preallocate.py on each of two forked CPU ranks (gloo, ``_forked_ranks``): CachePreallocator
under Lightning's DDP.

Each rank checks the pass left its state bit-identical and returns its final parameters.
"""

import lightning.pytorch as L
from _memory_helpers import Probe, TinyData, TinyLM, assert_same
from torch.nn.parallel import DistributedDataParallel

from lightning_seqmem.memory import CachePreallocator


class WrappedProbe(Probe):
    def on_fit_start(self, trainer, pl_module):
        super().on_fit_start(trainer, pl_module)
        assert isinstance(trainer.strategy.model, DistributedDataParallel)


def main(rank: int) -> dict:
    """One rank's run: three steps after the pass; returns ``{name: parameter}``."""
    L.seed_everything(0)
    model, before, after = TinyLM(), WrappedProbe(), Probe()
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[before, CachePreallocator(), after],
    )
    trainer.fit(model, datamodule=TinyData())
    assert trainer.global_rank == rank
    assert_same(before.state, after.state)
    assert model.seen[0]["shape"] == (2, 48)
    return {n: p.detach() for n, p in model.named_parameters()}
