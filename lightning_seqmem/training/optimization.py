"""``CausalLM``'s optimizer and schedule: AdamW with decay on matrices only, linear warmup then cosine decay.

Plain torch (no Lightning): the parameter grouping, the learning-rate factor per step and the scheduler that applies
it are functions a user's own module can call the same way. The optimizer is torch's AdamW (``"adamw"``) or
bitsandbytes' ``AdamW8bit`` (``"adamw_8bit"``): its two moments kept as ``uint8`` with an ``fp32`` scale per block
of 256 values (tensors under 4,096 values keep ``fp32`` moments), 2 bytes a parameter instead of 8, updated in place
by a fused kernel. bitsandbytes runs it on CUDA only, so it is refused elsewhere with the fix.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from lightning_seqmem.training.checks import require_bitsandbytes


def no_decay_names(module: torch.nn.Module) -> set[str]:
    """Parameters AdamW does not decay: biases and norm weights (fewer than 2 dimensions, or "norm" in the name).
    Ask before FSDP wraps the module: with ``use_orig_params`` every parameter becomes a 1-D shard."""
    return {name for name, p in module.named_parameters() if p.ndim < 2 or "norm" in name.lower()}


OPTIMIZERS = ("adamw", "adamw_8bit")


def check_optimizer(name: str, device: torch.device | str | None = None) -> None:
    """``name`` is one of :data:`OPTIMIZERS`; ``"adamw_8bit"`` also needs bitsandbytes and, when ``device`` is
    given (the Trainer's), a CUDA device.

    Raises:
        ValueError: an unknown name; ``"adamw_8bit"`` on a device that is not CUDA.
        ImportError: ``"adamw_8bit"`` without bitsandbytes installed.
    """
    if name not in OPTIMIZERS:
        raise ValueError(
            f"optimizer={name!r} is not valid; use 'adamw' (torch's AdamW) or 'adamw_8bit' (bitsandbytes' AdamW8bit: "
            "8-bit moments, CUDA only)."
        )
    if name != "adamw_8bit" or device is None:
        return
    require_bitsandbytes(
        "optimizer='adamw_8bit' (bitsandbytes' AdamW8bit)",
        "its kernels",
        "use optimizer='adamw' (model.optimizer=adamw), or train on a CUDA GPU",
        "its memory",
        device,
    )


def make_optimizer(
    name: str,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
    no_decay: set[str],
    learning_rate: float,
    weight_decay: float,
    betas: tuple[float, float],
) -> torch.optim.Optimizer:
    """AdamW (``name``: ``"adamw"`` or ``"adamw_8bit"``, :func:`check_optimizer`) over the trainable parameters:
    ``weight_decay`` on all but those named in ``no_decay``, which get 0."""
    check_optimizer(name)
    decay, plain = [], []
    for param_name, p in named_parameters:
        if p.requires_grad:
            (plain if param_name in no_decay else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    if name == "adamw_8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(groups, lr=learning_rate, betas=tuple(betas))
    return torch.optim.AdamW(groups, lr=learning_rate, betas=tuple(betas))


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine(
    optimizer: torch.optim.Optimizer, total_steps: float, warmup_ratio: float, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """The :func:`lr_factor` schedule over ``total_steps`` optimizer steps (10,000 when the Trainer cannot say:
    an infinite ``estimated_stepping_batches``), ``warmup_ratio`` of them warming up."""
    total = int(total_steps) if math.isfinite(total_steps) else 10_000
    warmup = int(warmup_ratio * total)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda s: lr_factor(s, warmup, total, min_lr_ratio))
