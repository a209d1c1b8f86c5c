"""Gradient clipping as the Trainer asks, with FSDP's own norm (mixed into ``CausalLM``)."""

from __future__ import annotations

import torch
from typing_extensions import override


class FsdpAwareClipping:
    """``configure_gradient_clipping`` for a LightningModule that may run under FSDP."""

    @override
    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip as the Trainer asks. Under FSDP, norm clipping goes through FSDP's own ``clip_grad_norm_`` (the norm
        of the whole gradient, over every rank's shards), which Lightning's FSDP precision plugin does not do."""
        from lightning.pytorch.strategies import FSDPStrategy

        if (
            gradient_clip_val
            and isinstance(self.trainer.strategy, FSDPStrategy)
            and gradient_clip_algorithm in (None, "norm")
        ):
            self.trainer.strategy.model.clip_grad_norm_(gradient_clip_val)
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
