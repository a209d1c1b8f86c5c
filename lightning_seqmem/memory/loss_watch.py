"""The training loss watched for its first non-finite value (``ConfigChecks``' ``nonfinite_loss`` check).

A run that goes NaN keeps training on garbage and says nothing; the watch names the step it happened and the
likely cause. Reading a CUDA loss on the host waits for the step to finish, so on an accelerator the losses are
kept on the device and read together every ``every_n_steps`` batches (``Trainer(log_every_n_steps)``, when
Lightning reads the logged loss anyway) and at the end of training: one host sync per N steps, and the warning
names the exact batch. A CPU loss is read every step (nothing to wait for).
"""

from __future__ import annotations

import math

import torch

__all__ = ["LossWatch", "nonfinite_loss_message"]


def nonfinite_loss_message(value: float, batch_idx: int, step: int, precision: str, adapter: bool) -> str:
    """The warning for a non-finite training loss ``value`` first seen at ``batch_idx`` (optimizer ``step``)."""
    where = f"the training loss is {value} at batch {batch_idx} (optimizer step {step}); later steps train on garbage."
    if precision.startswith("16-true") and not adapter:
        return (
            f"{where} Likely cause: full fine-tuning with fp16 weights (precision={precision!r}: no fp32 master copy, "
            "no loss scaling; fp16 overflows past 65504), which Axolotl's config checks flag for this reason. Use "
            "precision='bf16-mixed' (or 'bf16-true') where the GPU has bf16, '16-mixed' (fp32 master weights and a "
            "loss scaler), or train an adapter on the frozen base: CausalLM(lora=dict(r=16))."
        )
    return (
        f"{where} Likely causes: a learning rate too high, inputs or labels that are not finite, or an overflow "
        f"under precision={precision!r}. Lower the learning rate (or add warmup and gradient_clip_val), check the "
        "data, or use precision='bf16-mixed'."
    )


class LossWatch:
    """Finds the first non-finite loss, reading device losses in groups of ``every_n_steps``.

    Args:
        every_n_steps: batches between host reads of losses kept on an accelerator (>= 1).

    Example::

        watch = LossWatch(every_n_steps=50)
        found = watch.add(loss, batch_idx, step)  # (value, batch_idx, step) of the first non-finite loss, or None
        found = found or watch.flush()  # at the end of training
    """

    host_devices: tuple[str, ...] = ("cpu",)  # losses there are read at once (nothing to wait for)

    def __init__(self, every_n_steps: int = 50) -> None:
        self.every_n_steps = max(1, int(every_n_steps))
        self._pending: list[tuple[torch.Tensor, int, int]] = []

    def add(self, loss: object, batch_idx: int, step: int) -> tuple[float, int, int] | None:
        """Record one batch's loss; returns ``(value, batch_idx, step)`` of a non-finite one once it is read."""
        if not isinstance(loss, torch.Tensor):
            if isinstance(loss, (int, float)) and not math.isfinite(loss):
                return float(loss), batch_idx, step
            return None
        loss = loss.detach()
        if loss.device.type in self.host_devices:
            return self._read([(loss, batch_idx, step)])
        self._pending.append((loss, batch_idx, step))  # no host sync: read with the others
        return self.flush() if len(self._pending) >= self.every_n_steps else None

    def flush(self) -> tuple[float, int, int] | None:
        """Read the losses kept so far (one host sync)."""
        pending, self._pending = self._pending, []
        return self._read(pending) if pending else None

    @staticmethod
    def _read(pending: list[tuple[torch.Tensor, int, int]]) -> tuple[float, int, int] | None:
        values = torch.stack([loss.float().sum() for loss, _, _ in pending]).cpu()  # the one host sync
        finite = torch.isfinite(values)
        if bool(finite.all()):
            return None
        first = int((~finite).nonzero()[0])
        _, batch_idx, step = pending[first]
        return float(values[first]), batch_idx, step
