"""Run by test_dpo_distributed.py on each of two forked CPU ranks (gloo, ``_forked_ranks``): DPO under DDP or FSDP.

Two optimizer steps on packed pairs with norm clipping and CachePreallocator (its pass is the first recorded loss).
Rank 0 returns the losses, the policy's initial weights and the full weights after training (``model.*`` the policy,
``reference_model.*`` the frozen copy; FSDP: gathered); every rank checks that each batch holds whole pairs (both
sequences of every pair it numbers).
"""

import datasets
import lightning.pytorch as L
import numpy as np
from _memory_cpu_fsdp import CPUFSDPStrategy
from torch.distributed.fsdp import FullyShardedDataParallel

from lightning_seqmem import DPO, SeqMemDataModule
from lightning_seqmem.batch import SEQUENCE_INDEX
from lightning_seqmem.memory.preallocate import CachePreallocator


class RecordingDPO(DPO):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.losses, self.pairs_seen = [], 0

    def training_step(self, batch, batch_idx):
        index = batch[SEQUENCE_INDEX]
        sequences = int(index.max()) + 1
        assert sequences % 2 == 0 and set(index[index >= 0].unique().tolist()) == set(range(sequences))
        self.pairs_seen += sequences // 2
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss))
        return loss


def full_state(trainer, module):
    wrapper = trainer.strategy.model
    if isinstance(wrapper, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(wrapper):
            return {n: p.detach().clone() for n, p in module.named_parameters()}
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def main(rank: int, kind: str) -> dict | None:
    """One rank's run (``kind``: "ddp" or "fsdp"); rank 0 returns ``{"losses", "state", "initial"}``."""
    g = np.random.default_rng(0)
    rows = [
        {
            "prompt_ids": g.integers(3, 60, int(n)).tolist(),
            "chosen_ids": g.integers(3, 60, int(c)).tolist(),
            "rejected_ids": g.integers(3, 60, int(r)).tolist(),
        }
        for n, c, r in zip(g.integers(2, 12, 64), g.integers(1, 14, 64), g.integers(1, 10, 64))
    ]
    L.seed_everything(0)
    model = RecordingDPO(
        model_config=dict(
            model_type="llama",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        ),
        vocab_size=64,
        pad_token_id=0,
        learning_rate=1e-2,
        beta=0.5,
    )
    dm = SeqMemDataModule(
        dataset=datasets.Dataset.from_list(rows), strategy="pack", max_length=24, micro_batch_size=2, pad_token_id=0
    )
    initial = {n: p.detach().clone() for n, p in model.model.named_parameters()}
    strategy = CPUFSDPStrategy(process_group_backend="gloo") if kind == "fsdp" else "ddp"
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        gradient_clip_val=1.0,
        callbacks=[CachePreallocator()],
    )
    trainer.fit(model, datamodule=dm)
    assert all(np.isfinite(model.losses)) and model.pairs_seen > 0
    state = full_state(trainer, model)  # collective under FSDP: every rank gathers
    assert trainer.global_rank == rank
    return {"losses": model.losses, "state": state, "initial": initial} if rank == 0 else None
