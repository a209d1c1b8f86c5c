"""``on_oom="split"`` on two gloo ranks: what NCCL would hang on, held on CPU (issue 45).

- the window's gradient average, when the ranks' gradient sets differ (conditional compute, unused parameters),
  gives what DDP gives (a rank without a gradient adds zeros);
- an out-of-memory error outside the parts (the gradient reduction's allocations, the optimizer step) on one rank
  stops every rank at the same point, none left in a collective (``run_ranks`` kills ranks still running 3 s after
  the first failure: a rank that waited would show as killed);
- DDP broadcasts buffers again after a split window, as it does after its own synced backward.
"""

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from _forked_ranks import run_ranks
from test_oom_split import TINY, VOCAB, padded
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

from lightning_seqmem import CausalLM
from lightning_seqmem.oom.reduce import WindowReduction

PER_RANK = {r: [padded(rows=4, seed=10 * r + i) for i in range(4)] for r in range(2)}


class Branches(torch.nn.Module):
    """``a`` on every rank, ``b`` only on rank 0, ``c`` only on rank 1, ``d`` nowhere."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (torch.nn.Parameter(torch.ones(3)) for _ in range(4))

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        return (x * self.a).sum() + (5 * x * (self.b if rank == 0 else self.c)).sum()


def _average_rank(rank: int) -> tuple[dict, dict]:
    dist.init_process_group("gloo")
    x = torch.full((3,), float(rank + 1))
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(Branches(), find_unused_parameters=True)
    ddp(x, rank).backward()
    torch.manual_seed(0)
    ours = Branches()
    ours(x, rank).backward()
    WindowReduction(bucket_bytes=16)(ours.parameters(), 2, rank)  # small buckets: several, and one in place
    grads = [{n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()} for m in (ddp, ours)]
    del ddp  # while the group lives (a DDP reducer freed after the group is gone can hang); run_ranks ends it
    return {n.removeprefix("module."): g for n, g in grads[0].items()}, grads[1]


@pytest.mark.slow
def test_unequal_gradient_sets_average_as_ddp_does():
    """``b`` and ``c`` come out 5 and 10 (each used on one rank, zeros from the other), not summed into each other."""
    for ddp, ours in run_ranks(_average_rank, timeout=60):
        assert ours["d"] is None and ddp["d"] is None
        assert set(ours) == set(ddp)
        for name in "abc":
            torch.testing.assert_close(ours[name], ddp[name], rtol=0, atol=0)
        assert ours["b"].tolist() == [2.5] * 3 and ours["c"].tolist() == [5.0] * 3


class FailLargeAllocations(TorchDispatchMode):
    """Raise ``torch.OutOfMemoryError`` for any new tensor of ``numel`` elements or more (a CPU stand-in for the
    caching allocator running out while the gradient reduction makes its buffers)."""

    ALLOCATING = ("empty", "empty_like", "zeros", "zeros_like", "cat", "new_empty", "new_zeros")

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel = numel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in self.ALLOCATING and isinstance(out, torch.Tensor) and out.numel() >= self.numel:
            raise torch.OutOfMemoryError(f"injected: {name} of {out.numel()} elements")
        return out


class Injected(CausalLM):
    """Each rank reads its own micro-batches; on rank 1 an out-of-memory error is injected ``where``."""

    def __init__(self, where: str | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.where = where

    def train_dataloader(self):
        return DataLoader(PER_RANK[self.global_rank], batch_size=None)

    def on_train_start(self) -> None:
        super().on_train_start()
        if self.where == "optimizer" and self.global_rank == 1:  # after the closure, as the optimizer's state is made

            def fail(optimizer, args, kwargs):
                raise torch.OutOfMemoryError("injected: the optimizer's state")

            self.trainer.optimizers[0].register_step_post_hook(fail)

    def on_after_backward(self) -> None:
        if self.where == "reduction" and self.global_rank == 1:
            with FailLargeAllocations(1000):
                return super().on_after_backward()
        return super().on_after_backward()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        if self.where == "buffers" and self.global_rank == 1 and batch_idx == 1:  # after the first window
            self.model.model.rotary_emb.inv_freq.mul_(2.0)


def _fit_rank(rank: int, where: str | None, fsdp: bool = False) -> torch.Tensor:
    torch.manual_seed(0)
    model = Injected(where, model_config=TINY, vocab_size=VOCAB, pad_token_id=0, on_oom="split")
    strategy = "ddp"
    if fsdp:
        from _memory_cpu_fsdp import CPUFSDPStrategy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        layers = {LlamaDecoderLayer}
        strategy = CPUFSDPStrategy(
            auto_wrap_policy=layers, sharding_strategy="SHARD_GRAD_OP", process_group_backend="gloo"
        )
    trainer = L.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_epochs=1,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model)
    assert trainer.global_step == 2
    return model.model.model.rotary_emb.inv_freq.clone()


@pytest.mark.slow
@pytest.mark.parametrize(
    "where, fsdp, what",
    [
        ("reduction", False, "the window's gradient reduction (zero-filled gradients, bucket buffers)"),
        ("optimizer", False, "the optimizer step"),
        ("reduction", True, "FSDP's reduction of the window's gradient"),
    ],
)
def test_an_out_of_memory_error_outside_the_parts_stops_every_rank(where, fsdp, what):
    """DDP: in the reduction's allocations or the optimizer step; FSDP: in the room its reduce-scatter needs."""
    with pytest.raises(AssertionError) as failed:
        run_ranks(_fit_rank, where, fsdp, timeout=90)
    text = str(failed.value)
    assert "killed" not in text  # both ranks stopped by themselves, none waited in a collective
    assert f"rank 1 ran out of memory in {what}; every rank stops here" in text
    assert f"AgreedOutOfMemory: on_oom='split': rank 1 ran out of memory in {what} (see that rank's error)" in text


@pytest.mark.slow
def test_ddp_broadcasts_buffers_again_after_a_split_window():
    """Rank 1's rotary buffer changed after the first window: the next window's forward broadcasts rank 0's."""
    buffers = run_ranks(_fit_rank, "buffers", timeout=90)
    torch.testing.assert_close(buffers[1], buffers[0], rtol=0, atol=0)
