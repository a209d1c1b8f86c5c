"""``on_oom="split"`` under Lightning's ``FSDPStrategy`` (FSDP1): the parts of a micro-batch run without collectives.

Under DDP a split backward is local once DDP's reducer is off. FSDP talks to the other ranks inside the forward and
the backward themselves: it all-gathers a unit's parameters before the unit runs and reduce-scatters its gradient
after. A rank that runs out of memory between two of these leaves the others waiting in the next one. Rather than
making every rank run the same parts (the failing rank's halves matched by empty parts elsewhere, every collective
of every part paid again), the collectives are taken out of the region that can fail:

- the gradients stay unsharded on each rank through the window (FSDP's ``no_sync``: nothing reduce-scattered in a
  part's backward);
- the parameters are gathered *before* the parts, by a forward of one token without gradients
  (:func:`gather_parameters`), and stay gathered through the window: true for ``SHARD_GRAD_OP``, which does not
  reshard after the forward. ``FULL_SHARD`` and ``HYBRID_SHARD`` free each unit after its forward and gather it
  again in the backward, inside the parts: refused (:func:`check_sharding`). ``NO_SHARD`` (DDP's layout: use DDP)
  lost a part's gradient after a failed forward in our probe, and HSDP's ZeRO-2 variant is untested: both refused;
- the window's gradient is reduce-scattered once, at its last micro-batch, by FSDP itself: a forward and backward
  of one token with a zero loss outside ``no_sync`` (:func:`reduce_window`), which adds nothing to the gradients and
  runs FSDP's own reduction (its divisor, its sharding of the result).

So each rank runs as many parts as its own micro-batch needs, and the ranks meet only where they meet under DDP: the
agreement after each micro-batch, and the window's reduction. The two one-token passes cost a forward (and, once per
window, a backward) of a single token; the held gradient costs a full unsharded gradient on each rank, as ``no_sync``
always does. Each part is a forward through the FSDP root (Lightning's forward redirection) with its backward outside
it, as FSDP expects, so ``training_step`` itself runs outside the root (:func:`step_outside_root`). A failed attempt
needs no cleanup: FSDP sets its per-iteration state again in the next root forward (the next part), and under
``no_sync`` with gathered parameters its end-of-backward callback, which a failed backward never reaches, has nothing to
free or reduce. Reads FSDP1's handle fields and ``_sync_gradients`` (torch 2.x; FSDP1 is frozen). Evaluation steps run
inside the root's forward (Lightning's call): their parts, without gradients, are collective-free once the nested units
are gathered (:func:`gather_inside_root`), and a failed forward without gradients leaves nothing that the next forward
does not set again.
"""

from __future__ import annotations

from typing import Any

import torch

# Keeps a unit's parameters gathered after its forward (and, under no_sync, after its backward); tested.
KEEPS_GATHERED = ("SHARD_GRAD_OP",)


def is_fsdp_strategy(strategy: Any) -> bool:
    from lightning.pytorch.strategies import FSDPStrategy

    return isinstance(strategy, FSDPStrategy)


def check_sharding(strategy: Any) -> None:
    """Refuse a sharding strategy that gathers parameters inside the backward (where a part may fail)."""
    name = getattr(strategy.sharding_strategy, "name", str(strategy.sharding_strategy))
    if name not in KEEPS_GATHERED:
        raise ValueError(
            f"on_oom='split' under FSDP needs sharding_strategy='SHARD_GRAD_OP' (parameters kept gathered after a "
            f"unit's forward), got {name}"
            + (
                f": {name} gathers them again inside the backward, where a rank that runs out of memory would leave "
                "the others waiting"
                if name in ("FULL_SHARD", "HYBRID_SHARD")
                else " (not supported with splitting"
                + ("; NO_SHARD is DDP's layout: use strategy='ddp'" if name == "NO_SHARD" else "")
                + ")"
            )
            + ". Use FSDPStrategy(sharding_strategy='SHARD_GRAD_OP'), or on_oom='raise'."
        )


def step_outside_root(strategy: Any) -> None:
    """Make this strategy call ``training_step`` directly while the module is splitting (each part is then its own
    forward through the FSDP root, with its backward after it); otherwise Lightning's own call. Idempotent."""
    if getattr(strategy, "_seqmem_step_outside_root", False):
        return
    lightning_step = strategy.training_step

    def training_step(*args: Any, **kwargs: Any) -> Any:
        module = strategy.lightning_module
        if not getattr(module, "splitting", False):
            return lightning_step(*args, **kwargs)
        with strategy.precision_plugin.train_step_context():
            return module.training_step(*args, **kwargs)

    strategy.training_step = training_step
    strategy._seqmem_step_outside_root = True


def root_module(strategy: Any) -> Any:
    """The FSDP root wrapping the LightningModule, or ``None`` (not wrapped yet, or not FSDP)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = getattr(strategy, "model", None)
    return model if isinstance(model, FullyShardedDataParallel) else None


def _states(root: Any) -> list[Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return [m for m in root.modules() if isinstance(m, FullyShardedDataParallel)]


def flat_parameters(root: Any) -> list[torch.nn.Parameter]:
    """The flat parameters: the leaves gradients accumulate into (what a failed backward may have touched)."""
    return [s._handle.flat_param for s in _states(root) if s._handle is not None]


def hold_gradients(root: Any) -> None:
    """Enter ``no_sync`` for the window: what ``FullyShardedDataParallel.no_sync`` sets, left set across steps."""
    for state in _states(root):
        state._sync_gradients = False


def gather_bytes(root: Any) -> int:
    """Bytes :func:`gather_parameters` allocates: the unsharded flat parameters of the units not gathered yet, in
    their compute dtype (what the all-gathers write into)."""
    return sum(
        s._handle.flat_param._padded_unsharded_size.numel() * s._handle._fwd_bwd_param_dtype.itemsize
        for s in _states(root)
        if s._handle is not None and s._handle.needs_unshard()
    )


def reduce_bytes(root: Any) -> int:
    """Bytes :func:`reduce_window` may allocate: every unit's unsharded gradient once more in the reduction dtype
    (FSDP's cast and its padded copy before the reduce-scatter), an upper bound."""
    return sum(
        s._handle.flat_param._padded_unsharded_size.numel() * s._handle._reduce_dtype.itemsize
        for s in _states(root)
        if s._handle is not None
    )


def run_in_root(strategy: Any, module: Any, method: str, *args: Any) -> Any:
    """``module.<method>(*args)`` as a forward of the FSDP root (its parameters gathered, its backward hooked)."""
    return strategy._forward_redirection(strategy.model, module, method, *args)


def gather_parameters(strategy: Any, module: Any, method: str) -> None:
    """Gather every unit's parameters (a forward of one token without gradients) unless all are gathered already:
    after this the parts' forwards and (under ``no_sync``) backwards need no collective."""
    root = root_module(strategy)
    if any(s._handle is not None and s._handle.needs_unshard() for s in _states(root)):
        with torch.no_grad():
            run_in_root(strategy, module, method)


def gather_inside_root(root: Any, module: Any, method: str) -> None:
    """:func:`gather_parameters` from inside the root's forward (an evaluation step): the nested units gathered by a
    forward of one token, kept gathered through the step (no gradients: nothing frees them)."""
    if any(s._handle is not None and s._handle.needs_unshard() for s in _states(root)):
        with torch.no_grad():
            getattr(module, method)()


def reduce_window(strategy: Any, module: Any, method: str) -> None:
    """Leave ``no_sync`` and reduce-scatter the window's gradient once: a zero loss of one token through the root,
    whose backward adds nothing and runs FSDP's own reduction."""
    root = root_module(strategy)
    for state in _states(root):
        state._sync_gradients = True
    run_in_root(strategy, module, method).backward()


def one_token_loss(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """Zero times the logits of one token: reaches every trained parameter, adds nothing to their gradients."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    return model(input_ids=ids).logits.sum() * 0.0
