"""Run by test_fsdp_cpu_save.py on each of two forked CPU ranks (gloo): a tiny ``CausalLM`` under FSDP (the test-only
``CPUFSDPStrategy``, Lightning's own state-dict handling) takes one step and saves Lightning's full-state-dict
checkpoint; ``guard=False`` first undoes the library's guard, as a run without it would save."""

import lightning.pytorch as L
import numpy as np
from _memory_cpu_fsdp import CPUFSDPStrategy
from torch.distributed.fsdp import FullyShardedDataParallel

from lightning_seqmem import CausalLM, SeqMemDataModule
from lightning_seqmem.training import fsdp_cpu

TINY = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def main(rank: int, path: str, guard: bool = True) -> dict:
    import datasets

    g = np.random.default_rng(0)
    docs = [g.integers(2, 4000, n).tolist() for n in g.integers(8, 30, 16)]
    dm = SeqMemDataModule(
        datasets.Dataset.from_dict({"input_ids": docs}), strategy="pack", max_length=32, micro_batch_size=2
    )
    model = CausalLM(model_config=TINY, cross_entropy="full")
    if not guard:  # this forked rank only: Lightning's own offloading context, as before the fix
        fsdp_cpu.gather_full_state_dict_in_place = lambda strategy: False
    trainer = L.Trainer(
        strategy=CPUFSDPStrategy(process_group_backend="gloo"),
        accelerator="cpu",
        devices=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=dm)
    trainer.save_checkpoint(path)
    with FullyShardedDataParallel.summon_full_params(trainer.strategy.model, writeback=False):
        weights = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    return {"weights": weights, "step": trainer.global_step}
