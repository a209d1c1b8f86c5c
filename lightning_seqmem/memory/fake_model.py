"""The model the memory tracer runs: a Hugging Face causal LM built from its config, on fake tensors for the estimate
(:func:`build_fake_model`) or for real for the measured step (:func:`build_model`), its attention as the tracer can
run it (:func:`traced_attention`: flash and torch's varlen kernel traced as one fused causal kernel)."""

from __future__ import annotations

import copy

import torch

from lightning_seqmem.memory.precision import parameter_dtype
from lightning_seqmem.memory.trace import trace_errors
from lightning_seqmem.training.building import enable_checkpointing

_FLASH_TRACE = "seqmem_fused_causal"  # attention registered for tracing flash_attention_2/3 (see _flash_attention)


def _flash_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Stand-in for flash-attention 2/3 when tracing: a causal fused kernel, no mask, ``[batch, length, heads, dim]``
    out. Keeps what flash keeps for backward (output and log-sum-exp), so the memory is flash's."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _register_flash_trace() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(_FLASH_TRACE, _flash_attention)
    AttentionMaskInterface.register(_FLASH_TRACE, lambda *args, **kwargs: None)


def traced_attention(attn_implementation: str) -> str:
    """The attention implementation the tracer runs for ``attn_implementation`` (flash and torch's varlen kernel as
    :func:`_flash_attention`); a ``ValueError`` for one it cannot estimate."""
    if attn_implementation in ("eager", "sdpa"):
        return attn_implementation
    if attn_implementation == "auto":  # torch_varlen or sdpa: sdpa's mask makes it the larger of the two
        return "sdpa"
    # torch's varlen kernel, like flash, builds no mask and keeps [tokens, heads, dim] activations
    if attn_implementation.startswith("flash_attention") or attn_implementation == "torch_varlen":
        _register_flash_trace()
        return _FLASH_TRACE
    raise ValueError(
        f"attn_implementation={attn_implementation!r} cannot be estimated; use 'sdpa', 'eager', 'auto', "
        "'torch_varlen' or 'flash_attention_2'."
    )


def build_model(
    model_config, attn_implementation: str = "sdpa", precision: str = "32-true", gradient_checkpointing: bool = False
):
    """A Hugging Face causal LM from a ``transformers`` config in train mode, the way the tracer and the measured
    step (:mod:`~lightning_seqmem.memory.measured`) build it: weights in ``precision``'s dtype, attention as
    :func:`traced_attention` runs it. Built on the current device (or in the current ``FakeTensorMode``)."""
    from transformers import AutoModelForCausalLM

    implementation = traced_attention(attn_implementation)
    dtype = parameter_dtype(precision)  # built in its dtype: fake parameters cannot be cast in place
    # from_config writes the dtype into the config it is given: a copy, so the next estimate is built as asked
    config = copy.deepcopy(model_config)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation, dtype=dtype)
    model.train()
    if gradient_checkpointing:
        enable_checkpointing(model)
    return model


def build_fake_model(
    model_config, attn_implementation: str = "sdpa", precision: str = "32-true", gradient_checkpointing: bool = False
):
    """:func:`build_model` in a fresh ``FakeTensorMode``. Returns ``(mode, model)``; nothing is allocated for real."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False)
    with trace_errors(model_config), mode:
        model = build_model(model_config, attn_implementation, precision, gradient_checkpointing)
    # A packed batch has no attention_mask, so models that warn about padding (gpt2) read token values to decide;
    # fake tensors have none. The warning changes no memory: skip it in the traced model.
    for module in model.modules():
        if hasattr(module, "warn_if_padding_and_no_attention_mask"):
            module.warn_if_padding_and_no_attention_mask = lambda *args, **kwargs: None
    return mode, model
