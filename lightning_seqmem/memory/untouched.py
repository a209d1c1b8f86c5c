"""A throw-away training step: run it inside :func:`untouched` and the LightningModule is left as it was."""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningModule

from lightning_seqmem.training.loss import TokenLossNormalizer


@contextlib.contextmanager
def untouched(pl_module: LightningModule, wrapper: torch.nn.Module | None = None) -> Iterator[None]:
    """Run a throw-away training step: afterwards RNGs, buffers, torchmetrics states, plain scalar attributes of the
    LightningModule, its ``TokenLossNormalizer`` objects and module modes are as before, ``self.log`` calls were no-ops
    and all gradients are ``None``."""
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    buffers = {name: buf.detach().to("cpu", copy=True) for name, buf in pl_module.named_buffers()}
    modes = {module: module.training for module in pl_module.modules()}
    metrics = _metric_states(pl_module)
    # Plain counters a training_step may bump (e.g. CausalLM.real_tokens_seen).
    scalars = {k: v for k, v in vars(pl_module).items() if isinstance(v, (int, float, str, type(None)))}
    # A TokenLossNormalizer counts the throw-away batch's tokens into the step it opens: put its bookkeeping back,
    # so a user's module needs no reset() after the pass.
    normalizers = [(n, dict(vars(n))) for n in vars(pl_module).values() if isinstance(n, TokenLossNormalizer)]
    # self.log is not allowed in on_fit_start (and has no result collection yet): make it a no-op for this step.
    pl_module.log = pl_module.log_dict = lambda *args, **kwargs: None  # instance attributes shadow the methods
    pl_module.train()
    try:
        yield
    finally:
        del pl_module.log, pl_module.log_dict
        pl_module.zero_grad(set_to_none=True)
        if wrapper is not None:
            wrapper.zero_grad(set_to_none=True)
        for module, training in modes.items():
            module.training = training
        with torch.no_grad():
            for name, buf in pl_module.named_buffers():
                if name in buffers:
                    buf.copy_(buffers[name])
        _restore_metric_states(metrics)
        vars(pl_module).update(scalars)
        for normalizer, state in normalizers:
            vars(normalizer).clear()
            vars(normalizer).update(state)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng:
            torch.cuda.set_rng_state_all(rng["cuda"])


def _metric_states(pl_module: LightningModule) -> list[tuple[Any, dict[str, Any]]]:
    """torchmetrics states (not buffers) that a training_step may update."""
    from torchmetrics import Metric

    saved = []
    for module in pl_module.modules():
        if isinstance(module, Metric):
            names = [*getattr(module, "_defaults", {}), "_update_count", "_computed"]
            state = {name: copy.deepcopy(getattr(module, name)) for name in names if hasattr(module, name)}
            saved.append((module, state))
    return saved


def _restore_metric_states(saved: list[tuple[Any, dict[str, Any]]]) -> None:
    for module, state in saved:
        for name, value in state.items():
            setattr(module, name, value)
