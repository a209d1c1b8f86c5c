"""Token-weighted loss: every label token of an optimizer step counts the same, across micro-batches and ranks.

With ``accumulate_grad_batches=k`` a loss that is each micro-batch's own mean gives a micro-batch with 4 label
tokens as much weight as one with 46 (completion-only loss, the last batches of an epoch, warmup steps). The
optimizer step should follow the gradient of the mean over every label token of the step, on every rank (Hugging
Face's ``num_items_in_batch`` semantics). The total is only known after the last micro-batch, so:

1. each micro-batch backpropagates the SUM of its token losses divided by a fixed scale (a power of two, so the
   division is exact), chosen at the step's first micro-batch;
2. before the optimizer step, and before gradient clipping, the gradients are multiplied by
   ``scale * k * world_size / N``: Lightning divides every micro-batch loss by ``k``, DDP averages gradients over
   ranks, and ``N`` is the step's label-token count summed over micro-batches and ranks.

:class:`TokenLossNormalizer` keeps that per-step bookkeeping (plain object, no Lightning import). ``CausalLM`` uses
it (``loss_normalization="token"``); a user's own LightningModule needs two lines::

    def training_step(self, batch, batch_idx):
        return self.model(**batch, num_items_in_batch=self.token_loss.add(batch["labels"])).loss

    def on_before_optimizer_step(self, optimizer):
        self.token_loss.rescale_gradients(self)
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

    Zero when the step has no label token: its gradients are already zero, and stay zero (no NaN).
    """
    tokens = tokens.to(torch.float32)
    return torch.where(tokens > 0, scale * accumulate_grad_batches * world_size / tokens.clamp(min=1), 0.0)


class TokenLossNormalizer:
    """Per-step bookkeeping for a token-weighted loss (see the module docstring).

    Call :meth:`add` once per micro-batch and pass what it returns to a Hugging Face model as
    ``num_items_in_batch`` (its loss is then ``sum / scale``); call :meth:`rescale_gradients` in
    ``on_before_optimizer_step``, which Lightning calls after the last micro-batch's backward, after the fp16 grad
    scaler has unscaled the gradients and before it clips them. No state outlives a step, so a resumed run is
    bit-identical. A callback that runs ``training_step`` before training (``CachePreallocator``) leaves a count
    behind: call :meth:`reset` in ``on_train_start`` (``CausalLM`` does). Made for single-device, DDP and FSDP
    (gradients averaged over ranks); not for DeepSpeed, which scales accumulated gradients itself.

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

            def on_train_start(self):
                self.token_loss.reset()

            def on_before_optimizer_step(self, optimizer):
                loss = self.token_loss.rescale_gradients(self)  # the step's per-token loss over all ranks
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
            The step's per-token loss over all ranks (0-dim float tensor) when :meth:`add_loss` was called and the
            step has label tokens, else ``None``.
        """
        if self.tokens is None:
            return None
        tokens = reduce_sum(self.tokens.detach().clone())
        factor = rescale_factor(self.scale, accumulate_grad_batches, world_size, tokens)
        grads = [p.grad for p in parameters if p.grad is not None]
        for grad in grads:
            grad.mul_(factor.to(device=grad.device, dtype=grad.dtype))
        loss = None
        if self.loss_sum is not None and int(tokens) > 0:  # a step without label tokens has no loss to log
            total = reduce_sum(self.loss_sum.clone())
            loss = total / tokens.clamp(min=1).to(total.dtype)
        self.reset()
        return loss

    def rescale_gradients(self, pl_module: Any) -> torch.Tensor | None:
        """:meth:`rescale_gradients_` for a LightningModule: its parameters, its Trainer's accumulation, world size
        and strategy."""
        trainer = pl_module.trainer
        return self.rescale_gradients_(
            pl_module.parameters(), int(trainer.accumulate_grad_batches), int(trainer.world_size),
            lambda t: trainer.strategy.reduce(t, reduce_op="sum"),
        )
