"""The LM head and its cross-entropy without the whole logits: chunk by chunk, over the trained tokens only.

The full path computes ``logits = hidden_states @ head_weight.T`` for every position, ``[tokens, vocab]``, upcasts
them to fp32 and then takes the loss: with today's vocabularies (128,256; 151,936; 256,000) that tensor, its fp32
copy and their gradients are the largest thing in a training step, and every position labelled ``ignore_index``
(prompts, padding, a packed document's first token) goes through the head for nothing. :func:`linear_cross_entropy`
returns what ``F.cross_entropy`` returns on those logits, with the same gradients, but

1. selects the positions whose label is not ``ignore_index`` first (one host sync, for their count);
2. runs the head and the loss over ``chunk_size`` of them at a time in a custom autograd function that keeps no
   chunk's logits: one ``[chunk_size, vocab]`` fp32 buffer is live at a time (two with soft-capping), holding the
   logits, then their softmax, then the gradient of the loss with respect to them.

When the loss is a scalar (``reduction="mean"`` or ``"sum"``), the gradient of each chunk is known up to that
scalar's upstream gradient, so it is computed in the forward pass right after the chunk's loss, and backward only
multiplies them by it, in place (three matmuls per chunk, as many as the full path; Liger-Kernel does the same).
The gradients of the kept hidden states and of the head therefore exist from the loss's forward on, not from its
backward, and the graph backpropagates once (``retain_graph`` is refused with the way out). Per-token outputs
(``reduction="none"``, :func:`linear_token_logps` for DPO) get their upstream gradients only in backward, which
therefore computes each chunk's logits again (one matmul more per chunk).

Precision: the matmuls run in the inputs' dtype, or under autocast in the autocast dtype (as ``hidden @ W.T`` does
there); bias, logit scale, soft-capping, the softmax and the loss run in fp32 on the upcast logits (the full path
does those few element-wise steps in the autocast dtype before its upcast, so in bf16 the two differ by bf16
rounding, not more); the weight and bias gradients are accumulated over chunks in fp32 and returned in the
parameters' own dtype. ``logit_scale`` is a constant (a float), not a trained parameter. With 16-bit matmuls a chunk's
gradient of the logits is copied to their dtype and its fp32 buffer freed before the matmuls run, so a chunk peaks
at the two copies, ``6 * chunk_size * vocab`` bytes, while converting.

Torch only, no Lightning import. ``liger_cross_entropy.liger_linear_cross_entropy`` calls Liger-Kernel's fused
kernel instead (Triton, CUDA only, an optional extra).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake

from lightning_seqmem.batch import IGNORE_INDEX
from lightning_seqmem.messages import check_choice

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "REDUCTIONS",
    "linear_cross_entropy",
    "linear_token_logps",
]

REDUCTIONS = ("mean", "sum", "none")

DEFAULT_CHUNK_SIZE = 512
"""Tokens per chunk: a ``[512, vocab]`` fp32 buffer, 250 MiB at vocabulary 128,256 (8,192 tokens' full logits are
3.9 GiB). The largest that keeps the loss layer under 1/16 of the full path's memory there; smaller chunks are
slower (each reads and writes the whole weight gradient), larger ones a little faster (docs/loss.md)."""


_DISTINCT_CHUNKS = contextvars.ContextVar("distinct_chunks", default=False)


@contextlib.contextmanager
def distinct_chunks_only():
    """Run only the first and the last chunk of each pass (the memory tracer: fake tensors have no values to get
    wrong, and every full chunk allocates and frees the same ``[chunk_size, vocab]`` buffers into outputs made
    before the loop, so the peak of two chunks is the peak of all of them, for a fraction of the trace time)."""
    token = _DISTINCT_CHUNKS.set(True)
    try:
        yield
    finally:
        _DISTINCT_CHUNKS.reset(token)


def _chunk_starts(n: int, chunk_size: int) -> range | list[int]:
    starts = range(0, n, chunk_size)
    return sorted({starts[0], starts[-1]}) if _DISTINCT_CHUNKS.get() and len(starts) > 2 else starts


class _Head(NamedTuple):
    """What every chunk needs besides its tensors (plain values, so ``torch.compile`` sees constants)."""

    chunk_size: int
    dtype: torch.dtype  # the matmuls' dtype: the autocast dtype under autocast, else the hidden states'
    scale: float | None
    cap: float | None


def _chunk_softmax(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, head: _Head
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk's ``[n]`` token losses, ``[n, vocab]`` fp32 softmax (in the logits' own buffer) and, with
    soft-capping, the ``tanh`` the cap went through (its derivative needs it)."""
    logits = torch.mm(hidden, weight.t()).float()
    if bias is not None:
        logits.add_(bias)
    if head.scale is not None:
        logits.mul_(head.scale)
    tanh = None
    if head.cap is not None:
        tanh = logits.div_(head.cap).tanh_()
        logits = tanh * head.cap
    target_logits = logits.gather(1, targets[:, None]).squeeze(1)
    top = logits.amax(dim=1, keepdim=True)
    probs = logits.sub_(top).exp_()
    total = probs.sum(dim=1, keepdim=True)
    probs.div_(total)
    losses = total.log_().add_(top).squeeze(1) - target_logits
    return losses, probs, tanh


def _chunk_grad_logits(
    probs: torch.Tensor,
    tanh: torch.Tensor | None,
    targets: torch.Tensor,
    upstream: torch.Tensor | None,
    head: _Head,
    grad_bias: torch.Tensor | None,
) -> torch.Tensor:
    """Turn a chunk's softmax into the gradient of its losses (times ``upstream``, ``[n]`` or ``None`` for ones)
    with respect to ``hidden @ weight.T + bias``, in place, add its column sums to the bias accumulator, and return
    it in the matmuls' dtype (``probs`` itself when that is fp32, else a copy: the caller frees ``probs`` then)."""
    probs[torch.arange(len(targets), device=probs.device), targets] -= 1.0
    if upstream is not None:
        probs.mul_(upstream[:, None])
    if tanh is not None:  # d cap * tanh(x / cap) / dx = 1 - tanh^2
        probs.mul_(tanh.square_().neg_().add_(1.0))
    if head.scale is not None:
        probs.mul_(head.scale)
    if grad_bias is not None:
        grad_bias.add_(probs.sum(dim=0))
    return probs.to(head.dtype)


def _chunk_matmuls(
    grad_logits: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
    rows: slice,
) -> None:
    """Add what a chunk's ``grad_logits`` gives to the hidden rows' gradient and the weight's accumulator (``None``
    where no gradient is wanted)."""
    if grad_hidden is not None:
        torch.mm(grad_logits, weight, out=grad_hidden[rows])
    if grad_weight is not None:
        if grad_weight.dtype == grad_logits.dtype:
            grad_weight.addmm_(grad_logits.t(), hidden)
        else:  # fp32 accumulator, low-precision matmul
            _add_upcast(grad_weight, torch.mm(grad_logits.t(), hidden), len(hidden))


def _add_upcast(accumulator: torch.Tensor, partial: torch.Tensor, block_rows: int) -> None:
    """``accumulator += partial``, an fp32 ``[vocab, hidden]`` accumulator and a 16-bit partial, the same sums.

    CUDA kernels cast an operand of another dtype as they read it; CPU's ``TensorIterator`` first copies it whole
    to the common dtype, an fp32 temporary twice the partial's size, allocated with each chunk and invisible to the
    memory tracer (fake tensors run no kernel). On CPU the rows are added ``block_rows`` (the chunk's tokens) at a
    time, so that copy is never larger than the chunk's own ``[tokens, hidden]`` (fake tensors, the tracer's, run no
    kernel and allocate nothing in either way: one op for them, not a loop over the vocabulary to trace)."""
    if accumulator.device.type != "cpu" or is_fake(accumulator):
        accumulator.add_(partial)
        return
    for start in range(0, len(accumulator), block_rows):
        accumulator[start : start + block_rows].add_(partial[start : start + block_rows])


def _chunked_pass(hidden, weight, bias, targets, head: _Head, wanted, upstream=None):
    """Run every chunk: return the ``[n]`` fp32 losses and, for each of hidden, weight, bias that ``wanted`` asks
    for, the gradient of the losses' sum (or of their dot product with ``upstream``, ``[n]``) in that input's dtype
    (``None`` for the others). The weight and bias gradients (in fp32 where the matmuls run in fp32 on fp32
    parameters) are the accumulators themselves: no copy of ``[vocab, hidden]``."""
    device_type = hidden.device.type
    with torch.autocast(device_type, enabled=False):
        weight_c = weight.to(head.dtype)
        n = hidden.shape[0]
        losses = hidden.new_empty(n, dtype=torch.float32)
        grads = [
            hidden.new_empty(n, hidden.shape[1], dtype=head.dtype) if wanted[0] else None,
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if wanted[1] else None,
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if wanted[2] else None,
        ]
        for start in _chunk_starts(n, head.chunk_size):
            rows = slice(start, min(start + head.chunk_size, n))
            hidden_c, targets_c = hidden[rows].to(head.dtype), targets[rows]
            losses[rows], probs, tanh = _chunk_softmax(hidden_c, weight_c, bias, targets_c, head)
            if any(wanted):
                chunk_upstream = None if upstream is None else upstream[rows]
                grad_logits = _chunk_grad_logits(probs, tanh, targets_c, chunk_upstream, head, grads[2])
                # The fp32 softmax is spent once it is in the matmuls' dtype: freed before the matmuls (and, on
                # CPU, the workspaces their kernels allocate), not after, so a 16-bit chunk peaks at its fp32 and
                # 16-bit copies, [chunk_size, vocab] each, never at both plus the matmuls' outputs.
                del probs, tanh
                _chunk_matmuls(grad_logits, hidden_c, weight_c, grads[0], grads[1], rows)
                del grad_logits  # before the next chunk's logits are allocated
            else:
                del probs, tanh
    inputs = (hidden, weight, bias)
    return losses, [None if g is None else g.to(x.dtype) for g, x in zip(grads, inputs)]


class _SummedLoss(torch.autograd.Function):
    """``sum`` of the token losses; gradients computed in the forward pass, scaled by the upstream scalar in
    backward, in place: a second ``[vocab, hidden]`` tensor would be as large as the weight's gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, head: _Head):
        losses, ctx.grads = _chunked_pass(hidden, weight, bias, targets, head, ctx.needs_input_grad[:3])
        return losses.sum()

    @staticmethod
    def backward(ctx, grad_total):
        if ctx.grads is None:
            raise RuntimeError(
                "linear_cross_entropy(reduction='mean' or 'sum') backpropagates once (its gradients are scaled in "
                "place); for retain_graph=True use reduction='none' and reduce the losses yourself."
            )
        grads, ctx.grads = ctx.grads, None  # handed over, not copied: autograd keeps the weight's as its .grad
        return *[None if g is None else g.mul_(grad_total.to(g.dtype)) for g in grads], None, None


class _TokenLosses(torch.autograd.Function):
    """``[n]`` token losses; backward computes each chunk's logits again, with the upstream gradient per token."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, head: _Head):
        losses, _ = _chunked_pass(hidden, weight, bias, targets, head, (False, False, False))
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.head = head
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, bias, targets = ctx.saved_tensors
        wanted = ctx.needs_input_grad[:3]
        _, grads = _chunked_pass(hidden, weight, bias, targets, ctx.head, wanted, grad_losses.float())
        return *grads, None, None


def _head(hidden_states, head_weight, chunk_size, logit_scale, final_logit_softcapping) -> _Head:
    """Check the options and the shapes; the matmuls' dtype (autocast's where it is on, as ``hidden @ W.T``)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(
            f"chunk_size={chunk_size!r} must be an int >= 1 (tokens per chunk of the LM head and loss); "
            f"use e.g. chunk_size={DEFAULT_CHUNK_SIZE}."
        )
    if head_weight.dim() != 2 or hidden_states.shape[-1] != head_weight.shape[1]:
        raise ValueError(
            f"head_weight {tuple(head_weight.shape)} must be [vocab, hidden] with hidden = hidden_states' last "
            f"dimension ({tuple(hidden_states.shape)})."
        )
    device_type = hidden_states.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = torch.promote_types(hidden_states.dtype, head_weight.dtype)
    scale = None if logit_scale is None else float(logit_scale)
    cap = None if final_logit_softcapping is None else float(final_logit_softcapping)
    if cap is not None and cap <= 0:
        raise ValueError(f"final_logit_softcapping={final_logit_softcapping!r} must be > 0 (or None: no capping).")
    return _Head(chunk_size, dtype, scale, cap)


# Both public functions run eagerly inside a compiled model (a graph break at the call): the token selection has a
# data-dependent shape, and the chunk loop's length changes with every batch's number of trained tokens, so a
# traced loop would recompile per batch (and hand the compiler an unrolled loop it might schedule into more live
# chunks than one). The work is three large matmuls per chunk, which compiling would not speed up.
@torch.compiler.disable
def linear_cross_entropy(
    hidden_states: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    head_bias: torch.Tensor | None = None,
    logit_scale: float | None = None,
    final_logit_softcapping: float | None = None,
) -> torch.Tensor:
    """Cross-entropy of the LM head's logits, computed chunk by chunk over the non-ignored tokens only.

    Returns what ``F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction=reduction)`` returns
    for ``logits = softcap((hidden_states @ head_weight.T + head_bias) * logit_scale)`` (``softcap(x) = cap *
    tanh(x / cap)``, Gemma's ``final_logit_softcapping``), with the same gradients with respect to
    ``hidden_states``, ``head_weight`` and ``head_bias``, without ever holding more than ``chunk_size`` tokens'
    logits. Labels are used as given: shift them first for a causal LM.

    Args:
        hidden_states: ``[..., hidden]`` the last hidden states (after the final norm).
        head_weight: ``[vocab, hidden]`` the LM head's weight (a tied input embedding is fine: its gradient adds up).
        labels: ``[...]`` target ids, ``ignore_index`` where no loss is taken.
        ignore_index: the label of positions that are skipped (never go through the head).
        reduction: ``"mean"`` over the non-ignored tokens (NaN when there are none, as ``F.cross_entropy``),
            ``"sum"``, or ``"none"``: ``[...]`` fp32 losses, 0 at ignored positions.
        chunk_size: tokens per chunk; memory grows with ``chunk_size * vocab``, speed a little (docs/loss.md).
        head_bias: ``[vocab]`` the head's bias, if it has one.
        logit_scale: a constant the logits are multiplied by (e.g. Cohere's ``logit_scale``).
        final_logit_softcapping: the cap of ``cap * tanh(logits / cap)`` (Gemma 2), applied after the scale.

    Raises:
        ValueError: ``reduction`` not one of :data:`REDUCTIONS`, ``chunk_size < 1``, mismatched shapes.

    Example::

        hidden = model.model(input_ids).last_hidden_state[:, :-1]
        loss = linear_cross_entropy(hidden, model.lm_head.weight, labels[:, 1:])
    """
    check_choice("reduction", reduction, REDUCTIONS)
    head = _head(hidden_states, head_weight, chunk_size, logit_scale, final_logit_softcapping)
    if hidden_states.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels {tuple(labels.shape)} must have hidden_states' shape without its last dimension "
            f"({tuple(hidden_states.shape)})."
        )
    # Indexing by the kept positions copies their rows only, also from a view such as hidden[:, :-1]. One explicit
    # nonzero (not a boolean mask): the memory estimate's fake tensors answer it with every position.
    kept = (labels != ignore_index).nonzero(as_tuple=True)
    hidden, targets = hidden_states[kept], labels[kept]
    if reduction == "none":
        losses = _TokenLosses.apply(hidden, head_weight, head_bias, targets, head)
        return losses.new_zeros(labels.shape).index_put(kept, losses)
    total = _SummedLoss.apply(hidden, head_weight, head_bias, targets, head)
    if reduction == "sum":
        return total
    # No trained token: NaN as F.cross_entropy's mean, with its zero gradients (0 / 0 would make them NaN too).
    return total / len(targets) if len(targets) else total + float("nan")


@torch.compiler.disable
def linear_token_logps(
    hidden_states: torch.Tensor,
    head_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    head_bias: torch.Tensor | None = None,
    logit_scale: float | None = None,
    final_logit_softcapping: float | None = None,
) -> torch.Tensor:
    """``[N]`` fp32 log-probability of each target, ``log_softmax(logits.float()).gather(targets)``, chunked.

    The head and its options as in :func:`linear_cross_entropy`; every target counts (the caller selects the tokens,
    e.g. DPO's completion tokens). Backward computes each chunk's logits again, with each token's own upstream
    gradient.

    Args:
        hidden_states: ``[N, hidden]``.
        head_weight: ``[vocab, hidden]``.
        targets: ``[N]`` token ids in ``[0, vocab)``.

    Example::

        logps = linear_token_logps(hidden[mask], model.lm_head.weight, input_ids[:, 1:][mask])
    """
    head = _head(hidden_states, head_weight, chunk_size, logit_scale, final_logit_softcapping)
    if hidden_states.dim() != 2 or targets.shape != hidden_states.shape[:1]:
        raise ValueError(
            f"hidden_states {tuple(hidden_states.shape)} must be [N, hidden] and targets {tuple(targets.shape)} [N]."
        )
    return -_TokenLosses.apply(hidden_states, head_weight, head_bias, targets, head)
