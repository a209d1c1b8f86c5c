"""``CausalLM`` under Lightning's ``FSDPStrategy``: clipping with FSDP's own norm, rotary buffers kept in fp32.

- Clipping: Lightning's FSDP precision plugin does not clip by norm; :class:`FsdpAwareClipping` clips with FSDP's
  ``clip_grad_norm_`` (the norm of the whole gradient, over every rank's shards).
- Buffers: Lightning's FSDP mixed precision for ``"bf16-mixed"`` (and ``"16-mixed"``) sets ``buffer_dtype`` to the
  low precision, so FSDP stores a RoPE model's ``inv_freq`` in bf16: rotary phases off by up to radians at long
  positions, in every FSDP run, while DDP under the same precision keeps them in fp32. :func:`keep_buffers_fp32`
  (``CausalLM.setup``, before the strategy wraps the model) keeps the buffers in their own dtype where Lightning
  derives the config from the precision, and warns, naming ``buffer_dtype``, where the strategy was given its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override


def rotary_buffers(module: torch.nn.Module) -> list[str]:
    """Names of the floating-point buffers of rotary position modules (``inv_freq`` and the like)."""
    names = []
    for prefix, sub in module.named_modules():
        rotary = "rotary" in type(sub).__name__.lower()
        for name, buffer in sub.named_buffers(prefix=prefix, recurse=False):
            if buffer.is_floating_point() and (rotary or "inv_freq" in name):
                names.append(name)
    return names


def keep_buffers_fp32(strategy: Any, module: torch.nn.Module) -> bool:
    """Under an ``FSDPStrategy`` with a mixed precision that casts buffers, keep the rotary buffers in fp32.

    Where the strategy's mixed-precision config comes from Lightning's precision plugin (``mixed_precision`` not
    given) and the precision is ``"*-mixed"`` (autocast computes in the low precision anyway), the config is the
    plugin's with ``buffer_dtype=None``: FSDP leaves buffers in their own dtype, as DDP does. A config the user gave
    is not changed: a warning names ``buffer_dtype`` and the fix. Call it before the strategy wraps the model.

    Returns:
        Whether the config was changed.
    """
    from lightning.pytorch.strategies import FSDPStrategy

    if not isinstance(strategy, FSDPStrategy):
        return False
    config = strategy.mixed_precision_config
    if config is None or config.buffer_dtype in (None, torch.float32, torch.float64):
        return False
    names = rotary_buffers(module)
    if not names:
        return False
    if strategy.mixed_precision is None and str(strategy.precision_plugin.precision).endswith("-mixed"):
        strategy.mixed_precision = dataclasses.replace(config, buffer_dtype=None)
        return True
    rank_zero_warn(
        f"FSDP's mixed precision casts buffers to {config.buffer_dtype} (buffer_dtype), among them the rotary "
        f"position buffers {names[:3]}: rotary phases drift at long positions. Give the strategy "
        "mixed_precision=MixedPrecision(param_dtype=..., reduce_dtype=..., buffer_dtype=torch.float32) (or leave "
        "mixed_precision unset under a '*-mixed' precision: CausalLM then keeps them in fp32)."
    )
    return False


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
