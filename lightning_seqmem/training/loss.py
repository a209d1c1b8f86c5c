"""Token-weighted loss: every label token of an optimizer step counts the same, across micro-batches and ranks.

With ``accumulate_grad_batches=k`` a loss that is each micro-batch's own mean gives a micro-batch with 4 label
tokens as much weight as one with 46 (completion-only loss, the last batches of an epoch, warmup steps). The
optimizer step should follow the gradient of the mean over every label token of the step, on every rank (Hugging
Face's ``num_items_in_batch`` semantics). Lightning runs each micro-batch's backward before it fetches the next one,
so the step's total is only known after its last backward:

1. each micro-batch backpropagates the SUM of its token losses divided by a fixed scale (a power of two, so the
   division is exact), chosen at the step's first micro-batch;
2. right after the step's last backward (``on_after_backward`` of its last micro-batch), the gradients are
   multiplied by ``scale * k * world_size / N``: Lightning divides every micro-batch loss by ``k``, DDP averages
   gradients over ranks, and ``N`` is the step's label-token count summed over micro-batches and ranks.

The count and the factor stay on the device (no host sync); ranks add their counts and losses in one all-reduce.
Where the gradients are final: in every ``on_before_optimizer_step`` (callbacks' and the module's), in gradient
clipping and in the optimizer. Not yet in the callbacks' ``on_after_backward`` (Lightning calls those before the
module's), nor in any hook of an earlier micro-batch of the step (the gradients are partial sums there anyway).

:class:`TokenLossNormalizer` keeps that per-step bookkeeping (plain object, no Lightning import). ``CausalLM`` uses
it (``loss_normalization="token"``); a user's own LightningModule needs three lines::

    def training_step(self, batch, batch_idx):
        return self.model(**batch, num_items_in_batch=self.token_loss.add(batch["labels"])).loss

    def on_after_backward(self):
        self.token_loss.finish_step(self)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_seqmem.batch import count_label_tokens


def predicted_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Number of tokens a causal-LM loss predicts from ``[batch, seq]`` unshifted labels (0-dim long tensor).

    The batch contract's ``count_label_tokens`` for a bare labels tensor; stays on its device (no host sync).
    """
    return count_label_tokens({"labels": labels})


def power_of_two_scale(slots: int) -> float:
    """The largest power of two <= ``slots`` (at least 1): dividing by it is exact in floating point."""
    return float(2 ** max(0, math.floor(math.log2(max(1, slots)))))


def rescale_factor(scale: float, accumulate_grad_batches: int, world_size: int, tokens: torch.Tensor) -> torch.Tensor:
    """What turns the accumulated ``sum / scale / k`` gradients (averaged over ranks) into the per-token mean's.

    Zero when the step has no label token: its gradients are already zero, and stay zero (no NaN). Float64, so a
    count above 2**24 stays exact.
    """
    tokens = tokens.to(torch.float64)
    return torch.where(tokens > 0, scale * accumulate_grad_batches * world_size / tokens.clamp(min=1), 0.0)


def scale_gradients_(grads: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every gradient by the 0-dim ``factor`` in place: one fused (foreach) call per device and dtype, no
    host sync."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, dtype), group in groups.items():
        torch._foreach_mul_(group, factor.to(device=device, dtype=dtype))


class TokenLossNormalizer:
    """Per-step bookkeeping for a token-weighted loss (see the module docstring).

    Call :meth:`add` once per micro-batch and pass what it returns to a Hugging Face model as
    ``num_items_in_batch`` (its loss is then ``sum / scale``); call :meth:`finish_step` in ``on_after_backward``
    (it rescales at the step's last micro-batch, so every ``on_before_optimizer_step`` hook, clipping and the optimizer
    see the per-token mean's gradients), or :meth:`rescale_gradients` in ``on_before_optimizer_step`` (then only hooks
    that run after it do). Lightning calls both after the fp16 grad scaler's backward; the rescale is linear, so
    before or after its unscale is the same. No state outlives a step, so a resumed run is bit-identical.
    ``CachePreallocator`` runs ``training_step`` on a synthetic batch before training and puts every normalizer held
    as an attribute of the LightningModule back as it was, so no reset is needed after it; a normalizer kept
    elsewhere (a submodule, a dict) is not found: call :meth:`reset` in ``on_train_start`` then. Made for
    single-device, DDP and FSDP (gradients averaged over ranks); not for DeepSpeed, which scales accumulated
    gradients itself.

    Example::

        class MyLM(LightningModule):
            def __init__(self):
                super().__init__()
                self.model = AutoModelForCausalLM.from_config(config)
                self.token_loss = TokenLossNormalizer()

            def training_step(self, batch, batch_idx):
                loss = self.model(**batch, num_items_in_batch=self.token_loss.add(batch["labels"])).loss
                self.token_loss.add_loss(loss)  # only for logging the true per-token loss
                return loss

            def on_after_backward(self):
                loss = self.token_loss.finish_step(self)  # the step's per-token loss over all ranks, at its end
                if loss is not None:
                    self.log("train/loss", loss)
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget the current step (a run stopped mid-step must not carry its tokens into the next fit)."""
        self.scale: float | None = None
        self.tokens: torch.Tensor | None = None
        self.loss_sum: torch.Tensor | None = None

    def add(self, labels: torch.Tensor) -> float:
        """Count one micro-batch's label tokens; returns the step's loss scale (the ``num_items_in_batch`` to use).

        Args:
            labels: ``[batch, seq]`` unshifted labels, ``IGNORE_INDEX`` where no loss is taken.
        """
        if self.scale is None:
            self.scale = power_of_two_scale(labels[..., 1:].numel())
        n = predicted_tokens(labels)
        self.tokens = n if self.tokens is None else self.tokens + n
        return self.scale

    def add_loss(self, loss: torch.Tensor) -> None:
        """Record a micro-batch loss computed with :meth:`add`'s scale, for the step's true per-token loss."""
        value = loss.detach().float() * self.scale
        self.loss_sum = value if self.loss_sum is None else self.loss_sum + value

    def rescale_gradients_(
        self,
        parameters: Iterable[torch.nn.Parameter],
        accumulate_grad_batches: int,
        world_size: int,
        reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    ) -> torch.Tensor | None:
        """Turn the step's accumulated gradients into the per-token mean's, in place, and start a new step.

        Args:
            parameters: the trained parameters.
            accumulate_grad_batches: what Lightning divided each micro-batch loss by.
            world_size: ranks whose gradients DDP averaged.
            reduce_sum: sums a tensor over ranks (``trainer.strategy.reduce(t, reduce_op="sum")``); every rank must
                call this method at the same step.

        Returns:
            The step's per-token loss over all ranks (0-dim float32 tensor; 0 for a step without label tokens) when
            :meth:`add_loss` was called, else ``None``. Computed on the device: nothing here waits for it.
        """
        if self.tokens is None:
            return None
        counts = self.tokens.detach().to(torch.float64).reshape(1)
        if self.loss_sum is not None:  # one all-reduce for both
            counts = torch.cat([counts, self.loss_sum.to(torch.float64).reshape(1)])
        counts = reduce_sum(counts.clone())
        tokens = counts[0]
        scale_gradients_(
            [p.grad for p in parameters if p.grad is not None],
            rescale_factor(self.scale, accumulate_grad_batches, world_size, tokens),
        )
        loss = (counts[1] / tokens.clamp(min=1)).float() if self.loss_sum is not None else None
        self.reset()
        return loss

    def rescale_gradients(self, pl_module: Any) -> torch.Tensor | None:
        """:meth:`rescale_gradients_` for a LightningModule: its parameters, its Trainer's accumulation, world size
        and strategy."""
        trainer = pl_module.trainer
        return self.rescale_gradients_(
            pl_module.parameters(),
            int(trainer.accumulate_grad_batches),
            int(trainer.world_size),
            lambda t: trainer.strategy.reduce(t, reduce_op="sum"),
        )

    def finish_step(self, pl_module: Any) -> torch.Tensor | None:
        """Call in ``on_after_backward``: at the step's last micro-batch (where Lightning steps the optimizer next),
        :meth:`rescale_gradients` and return the step's loss; at the others, ``None``."""
        if pl_module.trainer.fit_loop._should_accumulate():  # the predicate Lightning steps on
            return None
        return self.rescale_gradients(pl_module)
