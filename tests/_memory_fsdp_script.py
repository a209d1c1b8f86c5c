"""Run by test_memory_fsdp.py on each of two forked CPU ranks (gloo, ``_forked_ranks``): CausalLM under FSDP or DDP.

Trains one step with norm clipping (gradient_clip_val=0.05, which clips) and CachePreallocator, on packed rows of
different label-token counts per rank. Each rank checks that the pass left its state bit-identical and returns its
step count and optimizer groups; rank 0 also returns the full gradient after clipping (FSDP: gathered with
summon_full_params).
"""

import datasets
import lightning.pytorch as L
import numpy as np
import torch
from _memory_cpu_fsdp import CPUFSDPStrategy
from _memory_helpers import Probe, assert_same
from torch.distributed.fsdp import FullyShardedDataParallel

from lightning_seqmem import CausalLM, SeqMemDataModule
from lightning_seqmem.memory.preallocate import CachePreallocator


class RecordingLM(CausalLM):
    """Keeps the first step's clipped gradient and, when asked, runs out of memory above 64 tokens."""

    def __init__(self, oom=False, **kwargs):
        super().__init__(**kwargs)
        self.oom, self.shapes, self.grads = oom, [], None

    def training_step(self, batch, batch_idx):
        self.shapes.append(tuple(batch["input_ids"].shape))
        if self.oom and batch["input_ids"].numel() > 64:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return super().training_step(batch, batch_idx)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if self.trainer.global_step != 0:
            return
        wrapper = self.trainer.strategy.model
        if isinstance(wrapper, FullyShardedDataParallel):
            with FullyShardedDataParallel.summon_full_params(wrapper, with_grads=True):
                self.grads = {n: p.grad.detach().clone() for n, p in self.named_parameters()}
        else:
            self.grads = {n: p.grad.detach().clone() for n, p in self.named_parameters()}


class WrapperCalls(L.Callback):
    """Counts calls of the strategy's wrapped module (FSDP: the pass must go through it)."""

    calls = 0

    def on_fit_start(self, trainer, pl_module):
        trainer.strategy.model.register_forward_pre_hook(lambda *args: setattr(self, "calls", self.calls + 1))


def main(rank: int, kind: str, oom: bool = False, chunked: bool = False) -> dict:
    """One rank's run (``kind``: "fsdp" or "ddp"). Returns ``{"done": "<steps> <params per optimizer group>",
    "grads": {name: clipped gradient}}`` (grads on rank 0 only); with ``oom``, ``{"oom": text}`` where rank 0's text
    is the error and the shapes the steps saw."""
    g = np.random.default_rng(0)
    docs = [g.integers(2, 64, n).tolist() for n in g.integers(3, 40, 48)]
    L.seed_everything(0)
    model = RecordingLM(
        oom,
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
        cross_entropy="chunked" if chunked else "full",
        loss_chunk_size=7,  # chunk boundaries inside every rank's tokens
    )
    dm = SeqMemDataModule(
        dataset=datasets.Dataset.from_dict({"input_ids": docs}),
        strategy="pack",
        max_length=32,
        micro_batch_size=3,
        pad_token_id=0,
    )
    strategy = CPUFSDPStrategy(process_group_backend="gloo") if kind == "fsdp" else "ddp"
    before, after, calls = Probe(), Probe(), WrapperCalls()
    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        gradient_clip_val=0.05,
        callbacks=[calls, before, CachePreallocator(), after],
    )
    try:
        trainer.fit(model, datamodule=dm)
    except torch.OutOfMemoryError as error:
        # The pass failed inside FSDP's forward, after its all-gather: Gloo's worker threads may still hold that
        # work, and tearing them down during interpreter finalization aborts the process ("terminate called without
        # an active exception"). Close the group while the interpreter is whole; the forked rank then leaves without
        # finalization (os._exit in _forked_ranks).
        torch.distributed.destroy_process_group()
        return {"oom": f"{type(error).__name__}: {error}\nshapes: {model.shapes}\n" if rank == 0 else None}
    assert_same(before.state, after.state)
    assert model.shapes[0] == (3, 32), model.shapes  # the pass ran the worst-case batch first
    if kind == "fsdp":
        assert calls.calls >= 2, calls.calls  # the pass and the real step both went through the FSDP wrapper
    assert trainer.global_rank == rank
    groups = [len(group["params"]) for group in trainer.optimizers[0].param_groups]  # weight decay, no decay
    return {"done": f"{trainer.global_step} {groups}", "grads": model.grads if rank == 0 else None}
