"""What an optimizer step allocates, as plain tensors: the pre-allocation pass reserves it without stepping.

The steady-state training step holds the optimizer's state (AdamW: two tensors per parameter, made at the first
``optimizer.step()``), the previous step's gradients during the forward (Lightning zeroes them after the
forward, before ``backward``) and, in ``optimizer.step()``, temporaries. None of that exists at ``on_fit_start``.
These functions allocate tensors of the same sizes, dtypes and devices, in the same groups, and touch nothing:
the caller drops them and the caching allocator keeps the blocks.

Optimizers known here: ``Adam``/``AdamW`` (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` with ``amsgrad``; the
``foreach`` step's ``sqrt`` of a whole group, or the single-tensor step's two temporaries of the largest
parameter; nothing for ``fused``), bitsandbytes' 8-bit Adam family (``AdamW8bit``: ``uint8`` moments and ``fp32``
block scales, :mod:`~lightning_seqmem.memory.optimizer_8bit`; a fused in-place step) and ``SGD`` with momentum
(``momentum_buffer``). Others: :func:`state_standins` returns ``None`` so the caller can say their state was not
reserved.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from lightning_seqmem.memory.optimizer_8bit import new_state


def trained_parameters(optimizers: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """Every parameter the optimizers update (each once), in group order."""
    seen: dict[int, torch.Tensor] = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    seen.setdefault(id(p), p)
    return list(seen.values())


def gradient_standins(parameters: list[torch.Tensor]) -> list[torch.Tensor]:
    """One ``zeros_like`` per parameter: the previous step's gradients, alive during the next forward."""
    return [torch.zeros_like(p) for p in parameters]


def _adam_family(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


def _adam_8bit(optimizer: torch.optim.Optimizer) -> bool:
    """bitsandbytes' two-state optimizers (``Adam8bit``, ``AdamW8bit``) at 8 bits: their ``args`` say so."""
    args = getattr(optimizer, "args", None)
    named = type(optimizer).__module__.startswith("bitsandbytes") and "Adam" in type(optimizer).__name__
    return named and getattr(args, "optim_bits", 32) == 8


def state_standins(optimizer: torch.optim.Optimizer) -> list[torch.Tensor] | None:
    """The state tensors the optimizer's first step will make for parameters that have none yet (a resumed
    optimizer needs nothing), or ``None`` for an optimizer this module does not know."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad or optimizer.state.get(p):
                continue
            if _adam_8bit(optimizer):
                # the two quantization maps (2 KiB) are the optimizer's, shared by every parameter: not reserved
                new = new_state(p, (None, None), optimizer.args.min_8bit_size)
                out += [t for t in new.values() if isinstance(t, torch.Tensor)]
            elif _adam_family(optimizer):
                out += [torch.zeros_like(p, memory_format=torch.preserve_format) for _ in range(2 + group["amsgrad"])]
            elif isinstance(optimizer, torch.optim.SGD):
                out += [torch.zeros_like(p)] if group["momentum"] else []
            else:
                return None
    return out


def _uses_foreach(group: dict, params: list[torch.Tensor]) -> bool:
    if group.get("foreach") is not None:
        return bool(group["foreach"])
    from torch.optim.optimizer import _default_to_fused_or_foreach

    return _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)[1]


def step_temporaries(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The largest set of temporaries alive at once inside ``optimizer.step()`` (allocate, then drop).

    Adam/AdamW ``foreach`` (torch's default on CUDA): ``torch._foreach_sqrt(exp_avg_sqs)``, one tensor per
    parameter of a (group, device, dtype) bucket, buckets one after the other; single-tensor (CPU):
    ``exp_avg_sq.sqrt() / bias_correction`` makes two tensors of the parameter being updated; ``fused``: none.
    """
    if not _adam_family(optimizer):
        return []
    largest: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.requires_grad]
        if not params or group.get("fused"):
            continue
        if _uses_foreach(group, params):
            buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
            for p in params:
                buckets[(p.device, p.dtype)].append(p)
            candidates = list(buckets.values())
        else:
            biggest = max(params, key=lambda p: p.numel() * p.element_size())
            candidates = [[biggest, biggest]]
        for bucket in candidates:
            if sum(p.numel() * p.element_size() for p in bucket) > sum(p.numel() * p.element_size() for p in largest):
                largest = bucket
    return [torch.empty_like(p) for p in largest]
