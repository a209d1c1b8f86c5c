"""Run one micro-batch's forward and backward, split in parts when it runs out of memory, with the same gradient.

:class:`OomSplitter` is torch only (no Lightning): ``CausalLM`` and ``DPO`` call it from their steps
(:mod:`~lightning_seqmem.oom.hooks`) with a forward that returns the part's share of the micro-batch's loss
(its token sum over the micro-batch's count, or its pairs' sum over the micro-batch's pairs), so the parts' losses
and gradients add up to the micro-batch's.

What stays exact when an attempt fails:

- in forward: nothing was accumulated; the graph is dropped, the cache freed, the two halves run;
- in backward: the autograd engine has already added the complete gradient of this part to the parameters nearest
  the loss (a parameter's gradient is accumulated once, when every path into it is done). Those parameters are
  recorded as it happens (a post-accumulate hook) and get zeros from the halves, the others get the halves' sum:
  every parameter receives the part's gradient once. Gradients of earlier micro-batches are never touched.

A part of ``limit`` tokens or more that ran out of memory once is split before it runs the next time
(:func:`~lightning_seqmem.oom.split.pre_split`), so a run pays one failed attempt, not one per step.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_seqmem.oom.split import Batch, batch_tokens, pre_split, split_batch

ON_OOM = ("raise", "split")
FIXES = (
    "a lower max_length (the DataModule's max_length; longer documents are cut or split), "
    "gradient_checkpointing=True, an adapter (lora=dict(r=16)), or run seqmem-plan for a configuration that fits"
)


class AgreedOutOfMemory(torch.OutOfMemoryError):
    """Raised on every rank at once, after the ranks agreed that one of them ran out of memory where nothing can be
    split (:mod:`~lightning_seqmem.oom.reduce`): no rank is left waiting in a collective."""


class RowDoesNotFit(AgreedOutOfMemory):
    """A single row (a single document or pair) ran out of memory: splitting cannot make it smaller."""


def is_out_of_memory(error: BaseException) -> bool:
    """A CUDA out-of-memory error: the caching allocator's ``torch.OutOfMemoryError``, or "CUDA error: out of
    memory" raised as ``torch.AcceleratorError`` by an allocation outside it (cuBLAS's workspace, NCCL's buffers)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    return accelerator_error is not None and isinstance(error, accelerator_error) and "out of memory" in str(error)


def memory_now(device: torch.device | None) -> tuple[int | None, int | None]:
    """``(allocated, reserved)`` bytes on a CUDA device; ``(None, None)`` elsewhere."""
    if device is None or device.type != "cuda":
        return None, None
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def free_memory(device: torch.device | None) -> None:
    """Collect the failed graph's cycles and hand the cached blocks back, so the halves start from a clean cache."""
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()


def first_line(error: BaseException) -> str:
    """The first line of an error's text (torch's out-of-memory message is long), or its type."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _gib(value: int | None) -> str:
    return "n/a (not CUDA)" if value is None else f"{value / 2**30:.2f} GiB"


def does_not_fit_message(event: dict[str, Any], rank: int | None = None) -> str:
    """The error for a row that cannot be split: where, how large, the memory then, torch's words, and the fixes."""
    where = f"rank {rank}: " if rank is not None else ""
    said = f" Torch said: {event['error']}." if event.get("error") else ""
    return (
        f"on_oom='split': {where}{event['stage']} step {event['step']}: a single row of {event['tokens']} tokens "
        f"(one document, or one preference pair) ran out of memory (allocated {_gib(event['allocated'])}, reserved "
        f"{_gib(event['reserved'])} at the time); splitting cannot make it smaller.{said} Fixes: {FIXES}."
    )


@dataclass
class Outcome:
    """What a micro-batch's run gave: the summed (detached) loss and extras of its parts, or the failure event of a
    row that does not fit."""

    loss: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    failed: dict[str, Any] | None = None

    def add(self, loss: torch.Tensor, extras: dict[str, torch.Tensor]) -> None:
        self.loss = loss if self.loss is None else self.loss + loss
        for key, value in extras.items():
            self.extras[key] = value if key not in self.extras else self.extras[key] + value


class OomSplitter:
    """Runs micro-batches in parts after an out-of-memory error and remembers the size that failed.

    Attributes:
        limit: the smallest part (tokens) that ran out of memory; later micro-batches this large or larger are
            split before they run. ``None`` until the first failure.
        splits: failed attempts so far (each one split a part in two).
        events: one dict per failed attempt: ``stage``, ``step``, ``tokens``, ``allocated``, ``reserved`` (bytes,
            CUDA, read while the failed attempt's tensors were still alive), ``error`` (torch's first line) and
            ``phase`` (``"forward"`` or ``"backward"``).
    """

    def __init__(self) -> None:
        self.limit: int | None = None
        self.splits = 0
        self.events: list[dict[str, Any]] = []
        self._watch: set[int] | None = None
        self._hooked: set[int] = set()

    def state_dict(self) -> dict[str, Any]:
        """The remembered size and count, so a resumed run does not pay the failure again."""
        return {"limit": self.limit, "splits": self.splits}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.limit, self.splits = state.get("limit"), int(state.get("splits", 0))

    def run(
        self,
        batch: Batch,
        forward: Callable[[Batch], tuple[torch.Tensor, dict[str, torch.Tensor]]],
        backward: Callable[[torch.Tensor], None] | None = None,
        parameters: Iterable[torch.nn.Parameter] = (),
        step: int = 0,
        device: torch.device | None = None,
        stage: str = "train",
    ) -> Outcome:
        """Run ``forward`` (and ``backward`` on its loss) over the batch, in parts where it runs out of memory.

        Args:
            batch: the micro-batch.
            forward: a part -> ``(loss, extras)``: its share of the micro-batch's loss and of any value to log.
            backward: what backpropagates a part's loss (with the Trainer's scaling); ``None``: evaluation.
            parameters: the trained parameters (their gradients are what a failed backward may have touched).
            step, device, stage: for the events and the error.

        Returns:
            The parts' summed loss and extras; ``failed`` set (and nothing raised) when a single row does not fit,
            so that the ranks can agree before anyone raises.
        """
        params = [p for p in parameters if p.requires_grad]
        self._hook(params)
        outcome = Outcome()
        queue = [(part, frozenset(), True) for part in pre_split(batch, self.limit)]
        while queue:
            part, done, counted = queue.pop(0)
            if params and len(done) == len(params):
                continue  # a failed backward had accumulated every parameter's share already
            value, accumulated, failure = self._attempt(part, forward, backward, params, done, device)
            if accumulated is None:
                if counted:
                    outcome.add(*value)
                continue
            tokens = batch_tokens(part)
            free_memory(device)
            event = dict(stage=stage, step=step, tokens=tokens, **failure)
            self.events.append(event)
            self.splits += 1
            halves = split_batch(part)
            if halves is None:
                outcome.failed = event
                return outcome
            self.limit = tokens if self.limit is None else min(self.limit, tokens)
            if value is not None and counted:  # the forward completed: its loss is known, the halves' not added
                outcome.add(*value)
                counted = False
            queue[0:0] = [(half, done | accumulated, counted) for half in halves]
        return outcome

    def agree(self, failed: bool, all_reduce_max: Callable[[torch.Tensor], torch.Tensor], device: torch.device):
        """Every rank's flag and remembered size in one all-reduce (max): whether some rank has a row that does not
        fit, and the smallest size that failed anywhere, which every rank then splits at. Returns the flag."""
        limit = float("inf") if self.limit is None else float(self.limit)
        flags = all_reduce_max(torch.tensor([float(failed), -limit], dtype=torch.float64, device=device))
        any_failed, neg_limit = flags.tolist()  # the one host read of the agreement
        if neg_limit != float("-inf"):
            self.limit = int(-neg_limit)
        return bool(any_failed)

    def _hook(self, params: list[torch.nn.Parameter]) -> None:
        """Record which parameters a backward has accumulated into (only while an attempt runs)."""
        for p in params:
            if id(p) not in self._hooked:
                p.register_post_accumulate_grad_hook(self._accumulated)
                self._hooked.add(id(p))

    def _accumulated(self, param: torch.nn.Parameter) -> None:
        if self._watch is not None:
            self._watch.add(id(param))

    def _attempt(self, part, forward, backward, params, done, device=None):
        """One try: ``((loss, extras), None, None)`` when it ran; ``((loss, extras) or None, accumulated ids, failure)``
        when it ran out of memory (the loss when the forward had completed; ``failure``: the memory and torch's text,
        read inside the handler, while the failed graph is still alive). Leaves no reference to the failed graph."""
        accumulated: set[int] = set()
        self._watch = accumulated
        # The share of these is in their gradients already: the halves add zeros to them.
        handles = [p.register_hook(torch.zeros_like) for p in params if id(p) in done]
        value = None
        try:
            loss, extras = forward(part)
            value = (loss.detach(), {k: v.detach() for k, v in extras.items()})
            if backward is not None:
                backward(loss)
            return value, None, None
        except Exception as error:
            if isinstance(error, AgreedOutOfMemory) or not is_out_of_memory(error):
                raise
            allocated, reserved = memory_now(device)
            phase = "forward" if value is None else "backward"
            failure = dict(allocated=allocated, reserved=reserved, error=first_line(error), phase=phase)
        finally:
            self._watch = None
            for handle in handles:
                handle.remove()
        return value, frozenset(accumulated), failure
