"""``torch_varlen``: torch's own varlen flash kernel as a transformers attention implementation; ``"auto"``.

Packed rows under SDPA make transformers build a ``[batch, 1, seq, seq]`` block-diagonal mask and run the masked
kernel. A varlen kernel runs every document on its own, with no mask, at the cost of one causal sequence per row;
flash-attn has one but no wheel for most setups. torch ships its own, ``torch.nn.attention.varlen.varlen_attn``
(torch >= 2.10; CUDA only, fp16/bf16, compute capability >= 8.0). Its keywords changed between releases
(``is_causal`` in the first; ``scale`` and ``window_size`` later; ``enable_gqa`` from 2.12), so the call adapts to
the signature it finds.

:func:`varlen_attention_forward` takes the varlen arguments transformers hands to flash kernels
(``cu_seq_lens_q``, ``max_length_q``: :func:`~lightning_seqmem.training.varlen.flash_varlen_kwargs`, which ``CausalLM``
passes). No mask function is registered for it, so transformers builds no mask (and runs none of its packed-sequence
detection) before calling it.

The kernel takes fp16/bf16 only, with one dtype for query, key and value; under autocast, rotary embeddings hand
query and key over in fp32 and value in the autocast dtype, so all three are cast back first, as transformers' own
flash path does (``tests/_flash_reference.py`` holds a CPU stand-in that makes the CUDA kernel's checks).

``attn_implementation="auto"`` (:func:`resolve_attn_implementation`): ``torch_varlen`` where the kernel runs (CUDA,
half precision, the kernel present), ``sdpa`` elsewhere.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from lightning_seqmem.training.varlen import TORCH_VARLEN, flash_varlen_kwargs

AUTO = "auto"
HALF_PRECISIONS = ("16-mixed", "bf16-mixed", "16-true", "bf16-true", "16", "bf16")


def varlen_kernel():
    """``torch.nn.attention.varlen.varlen_attn``, or ``None`` when this torch has none (before 2.10)."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    return getattr(varlen, "varlen_attn", None)


def varlen_unavailable_reason(device: torch.device | str, precision: str | None = None) -> str | None:
    """Why torch's varlen kernel cannot run on ``device`` at ``precision`` (a Lightning precision string), or
    ``None`` when it can."""
    if varlen_kernel() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (it came with torch 2.10)"
    reason = _device_reason(torch.device(device))
    if reason:
        return reason
    if precision is not None and str(precision) not in HALF_PRECISIONS:
        return f"torch's varlen (flash) kernel takes fp16/bf16 only, and precision={str(precision)!r}"
    return None


@functools.lru_cache(maxsize=16)
def _device_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"torch's varlen kernel runs on CUDA only, and the model runs on {device.type}"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "torch's varlen (flash) kernel needs a GPU of compute capability 8.0 or newer"
    return None


def resolve_attn_implementation(requested: str, device: torch.device | str, precision: str | None = None) -> str:
    """The implementation to run: ``"auto"`` becomes ``torch_varlen`` where the kernel runs, else ``"sdpa"``;
    ``torch_varlen`` where it cannot run is an error naming why; anything else is returned as is.

    Raises:
        ValueError: ``torch_varlen`` asked for where the kernel cannot run.
    """
    if requested not in (AUTO, TORCH_VARLEN):
        return requested
    reason = varlen_unavailable_reason(device, precision)
    if requested == AUTO:
        return "sdpa" if reason else register_varlen_attention()
    if reason:
        raise ValueError(
            f"attn_implementation={TORCH_VARLEN!r} cannot run here: {reason}. Use attn_implementation='auto' "
            "(the varlen kernel where it runs, SDPA elsewhere) or 'sdpa'."
        )
    return register_varlen_attention()


def register_varlen_attention() -> str:
    """Register :func:`varlen_attention_forward` with transformers as ``"torch_varlen"`` (idempotent); returns the
    name, for ``AutoModelForCausalLM.from_config(config, attn_implementation=...)``."""
    from transformers import AttentionInterface

    AttentionInterface.register(TORCH_VARLEN, varlen_attention_forward)
    return TORCH_VARLEN


@functools.lru_cache(maxsize=8)
def _keywords(kernel) -> frozenset[str]:
    return frozenset(inspect.signature(kernel).parameters)


def call_varlen_kernel(query, key, value, cu_seqlens, max_length, scale=None):
    """Causal varlen attention over ``[total, heads, dim]`` tensors with torch's kernel, whichever keyword form this
    torch release has (grouped key/value heads are repeated where the kernel cannot share them)."""
    kernel = varlen_kernel()
    keywords = _keywords(kernel)
    kwargs: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in keywords else {"is_causal": True}
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and "enable_gqa" in keywords:
        kwargs["enable_gqa"] = True
    elif groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if scale is not None and "scale" in keywords:
        kwargs["scale"] = scale
    elif scale is not None:
        query = query * (scale * query.shape[-1] ** 0.5)  # the kernel's default scale is 1/sqrt(dim)
    return kernel(query, key, value, cu_seqlens, cu_seqlens, max_length, max_length, **kwargs)


def _half_inputs(module: torch.nn.Module, query, key, value):
    """``query``, ``key``, ``value`` in the one half-precision dtype the flash kernel takes.

    Under autocast, rotary embeddings (computed in fp32) upcast ``query`` and ``key`` while ``value`` leaves its
    projection in the autocast dtype; the kernel refuses fp32 and mixed dtypes. Cast back to the dtype
    transformers' own flash path picks (the autocast dtype, else the quantized model's, else its first ``Linear``'s).
    """
    from transformers.integrations.flash_attention import get_target_dtype

    target = get_target_dtype(query, module) or query.dtype
    if target not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"attn_implementation={TORCH_VARLEN!r} runs in fp16/bf16 only, and the attention inputs are {target}: "
            "train with precision='bf16-mixed' (or '16-mixed', 'bf16-true'), or use attn_implementation='sdpa'."
        )
    return query.to(target), key.to(target), value.to(target)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``[batch, heads, seq, dim]`` in, ``[batch, seq, heads, dim]`` out.

    Segments: ``cu_seq_lens_q``/``max_length_q`` when given (over the flattened ``[batch * seq]`` rows), else from
    ``position_ids`` (one host sync per layer), else one causal sequence per row.
    """
    reason = varlen_unavailable_reason(query.device)
    if reason:
        raise RuntimeError(f"attn_implementation={TORCH_VARLEN!r}: {reason}. Use 'sdpa' or 'auto'.")
    if attention_mask is not None:
        raise ValueError(
            f"attn_implementation={TORCH_VARLEN!r} takes no attention mask: pass the varlen "
            "arguments (lightning_seqmem.training.varlen.flash_varlen_kwargs) to keep sequences apart."
        )
    if dropout and module.training:
        raise ValueError(f"attn_implementation={TORCH_VARLEN!r} has no attention dropout; set it to 0.")
    if getattr(module, "sliding_window", None):
        raise ValueError(f"attn_implementation={TORCH_VARLEN!r} does not do sliding-window attention; use 'sdpa'.")
    batch, heads, length, dim = query.shape
    cu, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is None and kwargs.get("position_ids") is not None:
        segments = flash_varlen_kwargs(kwargs["position_ids"].expand(batch, -1))
        cu, longest = segments["cu_seq_lens_q"], segments["max_length_q"]
    elif cu is None:
        cu = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=query.device)
        longest = length
    query, key, value = _half_inputs(module, query, key, value)
    flat = [t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value)]
    out = call_varlen_kernel(*flat, cu, int(longest), scale=scaling)
    return out.view(batch, length, heads, dim), None
