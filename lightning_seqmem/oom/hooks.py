"""``on_oom="split"`` wired into Lightning's automatic optimization (``CausalLM`` and ``DPO`` mix it in).

Why the backward moves into ``training_step``: an out-of-memory error in backward happens after ``training_step`` has
returned, inside Lightning's closure, where nothing can retry the micro-batch. So with ``on_oom="split"`` the step
runs the forward *and* the backward of its parts itself (:class:`~lightning_seqmem.oom.runner.OomSplitter`),
each part's loss treated as Lightning would treat the step's: divided by ``accumulate_grad_batches`` and scaled by
the precision plugin's ``GradScaler`` when there is one. It returns the micro-batch's loss detached, and
``backward`` (the hook Lightning's precision plugin calls; like ``optimizer_zero_grad`` and ``optimizer_step``
replaced on the instance under ``on_oom="split"`` only) skips the backward already done. Each part's backward runs
outside the precision plugin's autocast, as Lightning's own backward does. The rest
of Lightning's step is untouched: ``on_before_backward``/``on_after_backward`` once per micro-batch, the optimizer
stepped on the window's last one, clipping and the scaler's unscale/skip on the gradients the parts left, the
learning-rate schedule, ``SeqLengthWarmup`` (it reshapes the batch before the step). One hook moves: the window's
gradients are zeroed before its first forward (Lightning zeroes them between ``training_step`` and the backward,
which would drop the micro-batch's), so ``on_before_zero_grad`` runs after that micro-batch's backward.

Under DDP the gradient must be reduced once per window, and never in a backward that may fail halfway (a rank that
fails after launching some bucket all-reduces leaves the others waiting on buckets it will never send). So every
backward of a split run is local (DDP's ``require_backward_grad_sync`` off while the step's forward returns, put back
after), the ranks agree after each micro-batch (one all-reduce of a flag and the smallest size that failed: every
rank then splits the same sizes, and a row that fits nowhere stops every rank, none left in a collective), and the
window's averaged gradient is one bucketed all-reduce in ``on_after_backward`` of its last micro-batch
(:class:`~lightning_seqmem.oom.reduce.WindowReduction`: DDP's zeros for a gradient another rank has, its buffers
agreed on before the collective; an out-of-memory error in the optimizer step is agreed on too). That
reduction is not overlapped with the backward as DDP's is: the price of never hanging (``docs/oom.md``). Under FSDP
the parts are made collective-free the same way, its gathers moved before them and its reduce-scatter after the
window (:mod:`~lightning_seqmem.oom.fsdp`). DeepSpeed gathers and reduces inside every forward and backward,
so a rank's failure there is mid-collective: refused.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_seqmem.messages import check_choice
from lightning_seqmem.oom import fsdp as oom_fsdp
from lightning_seqmem.oom.reduce import WindowReduction, agree_or_raise, all_reduce_max, reserve, run_locally
from lightning_seqmem.oom.runner import (
    FIXES,
    ON_OOM,
    OomSplitter,
    Outcome,
    RowDoesNotFit,
    does_not_fit_message,
)
from lightning_seqmem.oom.split import Batch

log = logging.getLogger(__name__)


@contextlib.contextmanager
def pause_splitting(module: Any) -> Iterator[None]:
    """Run a module's steps as with ``on_oom="raise"`` for a while: a callback's trial step (``CachePreallocator``)
    must see the out-of-memory error it is there to report, and does its own backward."""
    paused = isinstance(module, SplitsOnOom) and not module._oom_paused
    if paused:
        module._oom_paused = True
    try:
        yield
    finally:
        if paused:
            module._oom_paused = False


def _reentrant(function: Any) -> bool:
    """Whether a transformers layer's checkpointing function is torch's reentrant checkpoint (its default)."""
    import torch.utils.checkpoint

    keywords = getattr(function, "keywords", {})
    if getattr(function, "func", function) is not torch.utils.checkpoint.checkpoint:
        return False
    return keywords.get("use_reentrant") in (None, True)


def check_checkpointing(model: torch.nn.Module | None) -> None:
    """Refuse reentrant checkpointing with a weight shared across checkpointed segments: each segment's inner backward
    accumulates into the shared weight on its own, so a failed attempt's record of what is accumulated (one
    accumulation per parameter, when every path into it is done) no longer holds and a split gives a wrong gradient.

    Raises:
        ValueError: naming a shared weight and the fix.
    """
    if model is None:
        return
    checkpointed = {
        name: module
        for name, module in model.named_modules()
        if getattr(module, "gradient_checkpointing", False) is True
        and _reentrant(getattr(module, "_gradient_checkpointing_func", None))
    }
    owners: dict[int, str] = {}
    for name, module in checkpointed.items():
        if any(other.startswith(f"{name}.") or (not name and other) for other in checkpointed):
            continue  # a model that holds checkpointed layers, not a segment itself
        for param_name, param in module.named_parameters():
            if not param.requires_grad:
                continue
            owner = owners.setdefault(id(param), name)
            if owner != name:
                raise ValueError(
                    f"on_oom='split' with reentrant gradient checkpointing: the weight {name}.{param_name} is shared "
                    f"with {owner}, another checkpointed segment, and a split would give it a wrong gradient. Use "
                    "non-reentrant checkpointing (CausalLM(gradient_checkpointing=True) does; or "
                    "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})), or "
                    "on_oom='raise'."
                )


class SplitsOnOom:
    """Mixed into a LightningModule: the split path of its steps (see the module docstring)."""

    def _init_oom(self, on_oom: str) -> None:
        check_choice("on_oom", on_oom, ON_OOM)
        self._oom = OomSplitter() if on_oom == "split" else None
        self._oom_backward_done = False
        self._oom_sync: bool | None = None  # DDP's require_backward_grad_sync, to put back after the step
        self._oom_paused = False
        self._oom_fsdp_held = False  # FSDP: gradients held unsharded (no_sync) until the window's end
        self._oom_reduction = WindowReduction()  # DDP: the window's gradient averaged by hand, its buffers kept
        if self._oom is not None:  # instance attributes: under on_oom="raise" no hook looks overridden to Lightning
            self.backward = self._split_aware_backward
            self.optimizer_zero_grad = self._split_aware_zero_grad
            self.optimizer_step = self._split_aware_optimizer_step

    @property
    def splitting(self) -> bool:
        """Whether the steps take the split path now (``on_oom="split"``, not paused by :func:`pause_splitting`)."""
        return self._oom is not None and not self._oom_paused

    @property
    def oom_splits(self) -> int:
        """Failed attempts this rank split (``protocols.SurvivesOom``); 0 with ``on_oom="raise"``."""
        return 0 if self._oom is None else self._oom.splits

    @property
    def oom_split_tokens(self) -> int | None:
        """The size (tokens) micro-batches are split below, after a failure; ``None`` before any."""
        return None if self._oom is None else self._oom.limit

    @property
    def oom_events(self) -> list[dict[str, Any]]:
        """One dict per out-of-memory error survived: ``stage``, ``step``, ``tokens``, ``allocated``, ``reserved``,
        ``error`` (torch's first line), ``phase`` (forward or backward)."""
        return [] if self._oom is None else list(self._oom.events)

    def _save_oom_state(self, checkpoint: dict[str, Any]) -> None:
        if self._oom is not None:
            checkpoint["oom_split"] = self._oom.state_dict()

    def _load_oom_state(self, checkpoint: dict[str, Any]) -> None:
        if self._oom is not None and "oom_split" in checkpoint:
            self._oom.load_state_dict(checkpoint["oom_split"])

    def _check_oom_strategy(self) -> None:
        """Refuse a strategy whose forward and backward talk to the other ranks where a part may fail (DeepSpeed,
        model parallel, FSDP sharding that gathers in the backward); under FSDP, step outside its root."""
        if self._oom is None or self._trainer is None:
            return
        check_checkpointing(self.model)
        strategy = self.trainer.strategy
        if oom_fsdp.is_fsdp_strategy(strategy):
            oom_fsdp.check_sharding(strategy)
            oom_fsdp.step_outside_root(strategy)
            return
        from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

        if isinstance(strategy, DeepSpeedStrategy):  # before the world size: one GPU fails in DeepSpeed's backward
            raise ValueError(
                "on_oom='split' does not run under DeepSpeed (at any world size): DeepSpeed runs the backward itself "
                "(its engine's backward, which the split step cannot replace) and gathers and reduces inside every "
                "forward and backward. Use strategy='ddp' (or FSDP with sharding_strategy='SHARD_GRAD_OP'), or "
                "on_oom='raise'."
            )
        if self.trainer.world_size > 1 and not isinstance(strategy, DDPStrategy):
            raise ValueError(
                f"on_oom='split' runs on one device, under DDP or under FSDP, not under {type(strategy).__name__}: "
                "its forward and backward gather and reduce with the other ranks, so a rank that runs out of memory "
                "halfway would leave them waiting. Use strategy='ddp', or on_oom='raise'."
            )

    def _ddp(self) -> Any:
        model = self.trainer.strategy.model if self._trainer is not None else None
        return model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None

    def _fsdp_root(self) -> Any:
        return oom_fsdp.root_module(self.trainer.strategy) if self._trainer is not None else None

    def _oom_part(self, part: Batch) -> tuple[torch.Tensor, dict]:
        """A part's forward, called through the FSDP root (:func:`oom_fsdp.run_in_root`)."""
        return self._oom_forward(part)

    def _oom_one_token(self) -> torch.Tensor:
        return oom_fsdp.one_token_loss(self.model, self.trainer.strategy.root_device)

    def _distributed(self) -> bool:
        return self._trainer is not None and self.trainer.world_size > 1 and torch.distributed.is_initialized()

    def split_backward(
        self, batch: Batch, batch_idx: int, forward: Callable[[Batch], tuple[torch.Tensor, dict]]
    ) -> Outcome:
        """Forward and backward of the micro-batch, in parts where needed; the parts' gradients scaled as Lightning
        scales the step's. Lightning's own backward of the returned (detached) loss is then skipped, and so is its
        ``zero_grad`` (it comes after ``training_step``): the window's first micro-batch zeroes them here."""
        trainer, ddp = self.trainer, self._ddp()
        if batch_idx % trainer.accumulate_grad_batches == 0:  # Lightning's first micro-batch of a window
            for optimizer in trainer.optimizers:
                optimizer.zero_grad()
        if ddp is not None:  # no reducer armed by this forward: every backward stays on this rank
            self._oom_sync, ddp.require_backward_grad_sync = ddp.require_backward_grad_sync, False
        k, scaler = int(trainer.accumulate_grad_batches), getattr(trainer.precision_plugin, "scaler", None)
        device_type = trainer.strategy.root_device.type

        def backward(loss: torch.Tensor) -> None:
            loss = loss / k
            # Outside the precision plugin's autocast, as Lightning runs its own backward: regions a model runs in
            # fp32 with autocast off (heads, routers) must not get low-precision backward matmuls.
            with torch.autocast(device_type, enabled=False):
                (scaler.scale(loss) if scaler is not None else loss).backward()

        root, params = self._fsdp_root(), None
        if root is not None:  # gradients held, parameters gathered: the parts need no collective (oom_fsdp)
            oom_fsdp.hold_gradients(root)
            self._oom_fsdp_held = True
            self._reserve_or_stop(oom_fsdp.gather_bytes(root), "FSDP's gather of the parameters before the parts")
            oom_fsdp.gather_parameters(trainer.strategy, self, "_oom_one_token")
            self._oom_forward, params = forward, oom_fsdp.flat_parameters(root)
            forward = functools.partial(oom_fsdp.run_in_root, trainer.strategy, self, "_oom_part")
        outcome = self._split_run(batch, forward, backward, "train", params)
        self._oom_backward_done = True
        self.log("train/oom_splits", float(self._oom.splits), batch_size=1, reduce_fx="max")
        if self._oom.limit is not None:
            self.log("train/oom_split_tokens", float(self._oom.limit), batch_size=1, reduce_fx="min")
        return outcome

    def split_evaluate(
        self, batch: Batch, forward: Callable[[Batch], tuple[torch.Tensor, dict]], stage: str = "validation"
    ) -> Outcome:
        """The loss of an evaluation batch, in parts where needed (no backward)."""
        root = self._fsdp_root()
        if root is not None:  # inside the root's forward: its units gathered first, the parts collective-free
            self._reserve_or_stop(oom_fsdp.gather_bytes(root), "FSDP's gather of the parameters before the parts")
            oom_fsdp.gather_inside_root(root, self, "_oom_one_token")
        return self._split_run(batch, forward, None, stage)

    def evaluation_loss(self, batch: Batch, label_tokens: torch.Tensor, stage: str) -> torch.Tensor:
        """``CausalLM``'s mean loss of an evaluation batch: ``self.loss(batch)``, or with ``on_oom="split"`` the sum
        of its parts' token losses over the batch's ``label_tokens``."""
        if not self.splitting:
            return self.loss(batch)
        return self.split_evaluate(batch, lambda part: (self.loss(part, label_tokens), {}), stage).loss

    def _split_run(self, batch, forward, backward, stage: str, params=None) -> Outcome:
        trainer = self.trainer
        device = trainer.strategy.root_device
        if params is None:
            params = self.parameters() if backward is not None else ()
        seen = len(self._oom.events)
        outcome = self._oom.run(batch, forward, backward, params, trainer.global_step, device, stage)
        if outcome.failed is None and len(self._oom.events) > seen:
            self._report_survived(batch, self._oom.events[seen:])
        failed = outcome.failed is not None
        if self._distributed():
            failed = self._oom.agree(failed, all_reduce_max, device)
        if failed:
            message = (
                does_not_fit_message(outcome.failed, trainer.global_rank if self._distributed() else None)
                if outcome.failed is not None
                else f"on_oom='split': {stage} step {trainer.global_step}: a single row on another rank ran out of "
                f"memory (see that rank's error); this rank stops with it. Fixes: {FIXES}."
            )
            raise RowDoesNotFit(message)
        return outcome

    def _report_survived(self, batch: Batch, events: list[dict[str, Any]]) -> None:
        """One line when a micro-batch survived running out of memory, at the time (not only in the run's summary)."""
        first = events[0]
        rank = f"rank {self.trainer.global_rank} " if self._distributed() else ""
        memory = "" if first["allocated"] is None else f", {first['allocated'] / 2**30:.2f} GiB allocated at the first"
        log.warning(
            f"on_oom='split': {rank}{first['stage']} step {first['step']}: a micro-batch of "
            f"{int(batch['input_ids'].numel())} tokens ran out of memory ({len(events)} failed attempt(s){memory}); it "
            f"ran in parts, same gradient. Micro-batches of {self._oom.limit} tokens or more are split before they "
            "run from now on."
        )

    def _reserve_or_stop(self, nbytes: int, what: str) -> None:
        """Several ranks: make room for ``nbytes`` before a collective that allocates them, and agree on it, so that a
        rank without room stops every rank instead of leaving them in the collective (:func:`reduce.reserve`)."""
        if nbytes > 0 and self._distributed():  # the same on every rank (FSDP's units gathered alike): no one waits
            device = self.trainer.strategy.root_device
            error = run_locally(lambda: reserve(nbytes, device))
            agree_or_raise(error, what, device, self.trainer.global_rank)

    def _split_aware_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``backward`` under ``on_oom="split"``: skip the backward :meth:`split_backward` has done; otherwise
        Lightning's."""
        if self._oom_backward_done:
            self._oom_backward_done = False
            return
        type(self).backward(self, loss, *args, **kwargs)

    def _split_aware_optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure=None) -> None:
        """``optimizer_step`` under ``on_oom="split"``: Lightning's (or the class's own); with several ranks, an
        out-of-memory error in it (the optimizer's state, the clipping) is agreed on with the other ranks, which
        would otherwise wait for this one at the next step's first collective."""
        step = type(self).optimizer_step
        if not (self.splitting and self._distributed()):
            return step(self, epoch, batch_idx, optimizer, optimizer_closure)
        error = run_locally(lambda: step(self, epoch, batch_idx, optimizer, optimizer_closure))
        agree_or_raise(error, "the optimizer step", self.trainer.strategy.root_device, self.trainer.global_rank)

    def _split_aware_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer_zero_grad`` under ``on_oom="split"``: Lightning zeroes gradients between ``training_step`` and
        the backward; after :meth:`split_backward` that would drop the micro-batch's gradient, zeroed already before
        it ran."""
        if not self._oom_backward_done:
            type(self).optimizer_zero_grad(self, epoch, batch_idx, optimizer)

    def _oom_after_backward(self) -> None:
        """Put DDP's flag back; at the window's last micro-batch, average the gradient over the ranks once."""
        ddp = self._ddp()
        if ddp is not None and self._oom_sync is not None:
            ddp.require_backward_grad_sync, self._oom_sync = self._oom_sync, None
        if self._oom_fsdp_held and not self.trainer.fit_loop._should_accumulate():
            self._oom_fsdp_held = False  # FSDP: the window's gradient reduce-scattered once, by FSDP
            self._reserve_or_stop(oom_fsdp.reduce_bytes(self._fsdp_root()), "FSDP's reduction of the window's gradient")
            oom_fsdp.reduce_window(self.trainer.strategy, self, "_oom_one_token")
        elif self._fsdp_root() is None and self._distributed() and not self.trainer.fit_loop._should_accumulate():
            self._oom_reduction(self.parameters(), self.trainer.world_size, self.trainer.global_rank)
            if ddp is not None:  # the next forward broadcasts buffers again, as after a synced DDP backward
                ddp.require_forward_param_sync = True
