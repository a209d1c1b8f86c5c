"""Run by test_adapters_fsdp.py on each of two forked CPU ranks (gloo, ``_forked_ranks``): a LoRA ``CausalLM`` on a
``pretrained_path`` base under FSDP or DDP, with ``SaveAdapter``.

Each rank trains on its half of the same packed rows; the adapter (gathered under FSDP) is recorded after every step.
A run can save a Lightning checkpoint at its end, or resume from one.
"""

import datasets
import lightning.pytorch as L
import numpy as np
from _memory_cpu_fsdp import CPUFSDPStrategy
from torch.distributed.fsdp import FullyShardedDataParallel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from lightning_seqmem import CausalLM, SeqMemDataModule
from lightning_seqmem.training.adapter_export import SaveAdapter

LORA = dict(r=4, alpha=8, dropout=0.0)
MAX_STEPS = 3  # two steps an epoch on each rank


def clean(name):
    return name.replace("_fsdp_wrapped_module.", "")


def adapter_weights(trainer, module):
    """The adapter's parameters, whole (FSDP: gathered), by name, on every rank."""
    wrapper = trainer.strategy.model
    if isinstance(wrapper, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(wrapper, writeback=False):
            return {clean(n): p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}


class AdapterSteps(L.Callback):
    """The adapter after each optimizer step, by global step (the step a resumed run starts from as well)."""

    def on_train_start(self, trainer, pl_module):
        self.steps[trainer.global_step] = adapter_weights(trainer, pl_module)

    def __init__(self, stop_at=None):
        self.steps, self.stop_at = {}, stop_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps[trainer.global_step] = adapter_weights(trainer, pl_module)
        trainer.should_stop = trainer.global_step == self.stop_at  # the schedule still spans max_steps


def main(
    rank: int, kind: str, base_dir: str, out_dir: str, stop_at=None, save=None, resume=None, sharded=False
) -> dict:
    """One rank's run (``kind``: "fsdp", each decoder layer its own FSDP unit, or "ddp") of ``MAX_STEPS`` steps, or
    stopped after ``stop_at``; ``save``: a checkpoint written at the end (a file; ``sharded``: FSDP's folder of
    shards); ``resume``: the checkpoint to resume from. Returns ``{"steps": {global step: adapter}, "saved_to": ...}``
    (steps on rank 0 only)."""
    g = np.random.default_rng(0)
    docs = [g.integers(2, 64, n).tolist() for n in g.integers(8, 30, 32)]
    L.seed_everything(0)
    model = CausalLM(pretrained_path=base_dir, lora=LORA, learning_rate=1e-2, cross_entropy="full")
    dm = SeqMemDataModule(
        dataset=datasets.Dataset.from_dict({"input_ids": docs}),
        strategy="pack",
        max_length=32,
        micro_batch_size=6,
        pad_token_id=0,
    )
    layers = {LlamaDecoderLayer}  # units inside the PEFT model: FSDP's names in its parameters' names
    state_dict_type = "sharded" if sharded else "full"  # sharded: each rank writes its shards (a folder)
    strategy = (
        CPUFSDPStrategy(auto_wrap_policy=layers, process_group_backend="gloo", state_dict_type=state_dict_type)
        if kind == "fsdp"
        else "ddp"
    )
    steps, export = AdapterSteps(stop_at), SaveAdapter(f"{out_dir}/adapter")
    trainer = L.Trainer(
        max_steps=MAX_STEPS,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=out_dir,
        callbacks=[steps, export],
    )
    trainer.fit(model, datamodule=dm, ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    return {"steps": steps.steps if rank == 0 else None, "saved_to": export.saved_to, "epoch": trainer.current_epoch}
