"""What the ranks do together around a split step, with every allocation it adds agreed on before a collective.

A rank that runs out of memory while the others already wait in a collective leaves them waiting until NCCL's
watchdog ends the job (gloo fails fast, which is why CPU runs never showed it). So each step of the split path that
allocates runs *locally first*, its failure caught, and the ranks agree (one all-reduce of a flag) before any of them
enters the collective that needs the allocation; when some rank failed, every rank raises
:class:`~lightning_seqmem.oom.runner.AgreedOutOfMemory` at the same point:

- :class:`WindowReduction`: the window's gradient averaged over the ranks as DDP averages it. The ranks first agree
  on which parameters have a gradient anywhere (a rank without one adds zeros, as DDP's buckets do; a parameter
  without a gradient on every rank keeps ``None``), then the zero-filled gradients and the bucket buffers (allocated
  once, reused by every window) are made locally and agreed on, and only then the buckets are all-reduced: copies into
  the buffers and back, nothing allocated between the agreement and the last bucket.
- :func:`agree_or_raise`: the agreement itself, used also after the optimizer step and around FSDP's gather and
  reduce (:mod:`~lightning_seqmem.oom.fsdp`, through :func:`reserve`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_seqmem.oom.runner import AgreedOutOfMemory, first_line, is_out_of_memory

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return tensor


def run_locally(fn: Callable[[], Any]) -> BaseException | None:
    """Run ``fn``; the out-of-memory error it raised (``None`` when it ran). Any other error propagates."""
    try:
        fn()
    except AgreedOutOfMemory:
        raise
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        return error
    return None


def agree_or_raise(error: BaseException | None, what: str, device: torch.device, rank: int) -> None:
    """Every rank's failure flag in one all-reduce; when any rank failed, raise on every rank (this one with its own
    error's text, the others naming the rank that failed)."""
    flags = torch.tensor([float(rank) if error is not None else -1.0], dtype=torch.float64, device=device)
    failed_rank = int(all_reduce_max(flags).item())  # the highest failed rank, or -1
    if failed_rank < 0:
        return
    if error is not None:
        raise AgreedOutOfMemory(
            f"on_oom='split': rank {rank} ran out of memory in {what}; every rank stops here, none is left waiting. "
            f"Torch said: {first_line(error)}. Fixes: more room (a lower max_length, gradient_checkpointing=True, "
            "optimizer='adamw_8bit', an adapter), or run seqmem-plan for a configuration that fits."
        ) from error
    raise AgreedOutOfMemory(
        f"on_oom='split': rank {failed_rank} ran out of memory in {what} (see that rank's error); this rank stops "
        "with it."
    )


def reserve(nbytes: int, device: torch.device) -> None:
    """Allocate ``nbytes`` and free them again: on CUDA the block stays in the caching allocator, so the collective
    that follows is served from it. Raises the out-of-memory error where there is no room (before any collective)."""
    if nbytes > 0:
        block = torch.empty(nbytes, dtype=torch.uint8, device=device)
        del block


class WindowReduction:
    """Average gradients over the default process group in place, as DDP does (see the module docstring).

    Args:
        bucket_bytes: the most bytes per bucket (one all-reduce each); a buffer of at most this size per dtype is kept.
    """

    def __init__(self, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.bucket_bytes = bucket_bytes
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def __call__(self, parameters: Iterable[torch.nn.Parameter], world_size: int, rank: int) -> None:
        params = [p for p in parameters if p.requires_grad]
        if not params:
            return
        device = params[0].device
        present = torch.tensor([float(p.grad is not None) for p in params], device=device)
        anywhere = all_reduce_max(present).tolist()
        params = [p for p, flag in zip(params, anywhere) if flag]
        error = run_locally(lambda: self._prepare(params))
        agree_or_raise(error, "the window's gradient reduction (zero-filled gradients, bucket buffers)", device, rank)
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in params:
            groups.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
        for key, grads in groups.items():
            self._reduce(grads, self._buffers.get(key), world_size)

    def _prepare(self, params: list[torch.nn.Parameter]) -> None:
        """Zeros for gradients some other rank has; a bucket buffer per dtype, made once (both can run out of memory:
        before the agreement)."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        totals: dict[tuple[torch.dtype, torch.device], int] = {}
        for p in params:
            if p.grad.is_contiguous():
                key = (p.grad.dtype, p.grad.device)
                totals[key] = totals.get(key, 0) + p.grad.numel()
        for (dtype, device), numel in totals.items():
            size = min(numel, max(1, self.bucket_bytes // dtype.itemsize))
            buffer = self._buffers.get((dtype, device))
            if buffer is None or buffer.numel() < size:
                self._buffers[(dtype, device)] = None  # the old one freed before the new one is made
                self._buffers[(dtype, device)] = torch.empty(size, dtype=dtype, device=device)

    @staticmethod
    def _reduce(grads: list[torch.Tensor], buffer: torch.Tensor | None, world_size: int) -> None:
        """All-reduce ``grads`` through ``buffer`` in buckets; a gradient larger than the buffer (or not contiguous)
        in place on its own. Nothing is allocated."""
        bucket: list[torch.Tensor] = []
        used = 0
        capacity = 0 if buffer is None else buffer.numel()

        def flush() -> None:
            nonlocal bucket, used
            if bucket:
                flat = buffer[:used]
                torch.distributed.all_reduce(flat)
                flat.div_(world_size)
                offset = 0
                for grad in bucket:
                    grad.view(-1).copy_(flat[offset : offset + grad.numel()])
                    offset += grad.numel()
            bucket, used = [], 0

        for grad in grads:
            if not grad.is_contiguous() or grad.numel() > capacity:
                torch.distributed.all_reduce(grad)
                grad.div_(world_size)
                continue
            if used + grad.numel() > capacity:
                flush()
            buffer[used : used + grad.numel()].copy_(grad.view(-1))
            bucket.append(grad)
            used += grad.numel()
        flush()
