"""``CausalLM``'s optimizer and schedule: AdamW with decay on matrices only, linear warmup then cosine decay.

Plain torch (no Lightning): the parameter grouping, the learning-rate factor per step and the scheduler that applies
it are functions a user's own module can call the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def no_decay_names(module: torch.nn.Module) -> set[str]:
    """Parameters AdamW does not decay: biases and norm weights (fewer than 2 dimensions, or "norm" in the name).
    Ask before FSDP wraps the module: with ``use_orig_params`` every parameter becomes a 1-D shard."""
    return {name for name, p in module.named_parameters() if p.ndim < 2 or "norm" in name.lower()}


def adamw(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
    no_decay: set[str],
    learning_rate: float,
    weight_decay: float,
    betas: tuple[float, float],
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters: ``weight_decay`` on all but those named in ``no_decay``, which get 0."""
    decay, plain = [], []
    for name, p in named_parameters:
        if p.requires_grad:
            (plain if name in no_decay else decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}],
        lr=learning_rate,
        betas=tuple(betas),
    )


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
