"""Exact CPU reference kernels behind transformers' real flash-attention dispatch (no flash-attn on CPU).

``use_reference_flash(monkeypatch)`` installs fake ``flash_attn`` (FA2), ``flash_attn_interface`` (FA3) and hub
``kernels`` packages whose functions are SDPA loops that honour ``cu_seqlens`` and ``causal``; transformers then
imports them through ``_lazy_imports`` exactly as it would the CUDA kernels. Only the environment checks (package
installed, CUDA device) are bypassed.

``use_reference_torch_varlen(monkeypatch, form)`` replaces torch's own ``torch.nn.attention.varlen.varlen_attn``
(CUDA only) with the same SDPA loop, under the keyword form of a given torch release (``TORCH_VARLEN_FORMS``), and
bypasses only ``lightning_seqmem.training.attention``'s device check.
"""

import sys
import types

import torch
import torch.nn.functional as F


def _attend(q, k, v, softmax_scale, causal):
    """``[seq, heads, dim]`` -> ``[seq, heads, dim]``; GQA like flash (query heads share key/value heads)."""
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=softmax_scale, enable_gqa=k.shape[0] != q.shape[0]
    )
    return out.transpose(0, 1)


def flash_attn_func(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False
):
    """``[batch, seq, heads, dim]``: every row is one sequence."""
    return torch.stack([_attend(q[b], k[b], v[b], softmax_scale, causal) for b in range(q.shape[0])])


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    deterministic=False,
):
    """``[total, heads, dim]``: sequence i is ``cu_seqlens[i]:cu_seqlens[i + 1]``."""
    assert torch.equal(cu_seqlens_q, cu_seqlens_k) and cu_seqlens_q.dtype == torch.int32
    assert int(cu_seqlens_q[-1]) == q.shape[0]
    lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    assert max(lengths) == max_seqlen_q == max_seqlen_k
    return _segments(q, k, v, cu_seqlens_q, softmax_scale, causal)


def _segments(q, k, v, cu_seqlens, softmax_scale, causal):
    """``[total, heads, dim]``: each segment ``cu_seqlens[i]:cu_seqlens[i + 1]`` attends only to itself."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    out = torch.empty_like(q)
    for start, n in zip(cu_seqlens[:-1].tolist(), lengths):
        out[start : start + n] = _attend(
            q[start : start + n], k[start : start + n], v[start : start + n], softmax_scale, causal
        )
    return out


def use_reference_flash(monkeypatch) -> None:
    """Make ``flash_attention_2``, ``flash_attention_3`` and ``kernels-community/...`` run the reference kernels."""
    from transformers import modeling_flash_attention_utils as fa_utils
    from transformers import modeling_utils
    from transformers.integrations import hub_kernels

    fa2 = types.ModuleType("flash_attn")
    fa2.flash_attn_func, fa2.flash_attn_varlen_func, fa2.flash_attn_with_kvcache = (
        flash_attn_func,
        flash_attn_varlen_func,
        None,
    )
    padding = types.ModuleType("flash_attn.bert_padding")
    padding.pad_input, padding.unpad_input = fa_utils._pad_input, fa_utils._unpad_input
    fa3 = types.ModuleType("flash_attn_interface")
    fa3.flash_attn_func, fa3.flash_attn_varlen_func, fa3.flash_attn_with_kvcache = (
        fa2.flash_attn_func,
        fa2.flash_attn_varlen_func,
        None,
    )
    for name, module in (("flash_attn", fa2), ("flash_attn.bert_padding", padding), ("flash_attn_interface", fa3)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(fa_utils, "is_flash_attn_2_available", lambda *a, **k: True)
    monkeypatch.setattr(fa_utils, "_loaded_implementation", None)  # forget any earlier import
    monkeypatch.setattr(modeling_utils.PreTrainedModel, "_flash_attn_can_dispatch", lambda *a, **k: True)
    # Hub kernels: transformers' own loader, with the download replaced by the reference module.
    monkeypatch.setattr(hub_kernels, "is_kernels_available", lambda: True)
    monkeypatch.setattr(hub_kernels, "get_kernel", lambda *a, **k: fa2)


# ------------------------------------------------------------------------------------- torch's own varlen kernel
CALLS = []  # (form, number of segments) of every call of the torch varlen stand-in


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def check_flash_varlen_inputs(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k) -> None:
    """The checks torch's flash varlen kernel makes before it runs (``mha_varlen_fwd`` in
    ``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``), with its messages: a stand-in that
    accepted what the CUDA kernel refuses would pass a test that fails on the first GPU step."""
    _check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype, "query and key must have the same dtype")
    _check(v.dtype == q.dtype, "query and value must have the same dtype")
    for name, cu in (("cu_seqlens_q", cu_seq_q), ("cu_seqlens_k", cu_seq_k)):
        _check(cu.dtype == torch.int32, f"{name} must have dtype int32")
        _check(cu.is_contiguous() and cu.ndim == 1, f"{name} must be contiguous")
    _check(len({t.device for t in (q, k, v, cu_seq_q, cu_seq_k)}) == 1, "Tensor must be on CUDA device")
    _check(all(t.stride(-1) == 1 for t in (q, k, v)), "Input tensor must have contiguous last dimension")
    _check(q.ndim == k.ndim == v.ndim == 3, "q, k, v must be [total, heads, head_size]")
    total_q, heads, head_size = q.shape
    _check(head_size <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(head_size % 8 == 0, "head_size must be a multiple of 8, this is ensured by padding!")
    _check(heads % k.shape[1] == 0, "Number of heads in key/value must divide number of heads in query")
    _check(k.shape == v.shape and k.shape[2] == head_size, "k and v sizes check failed")
    _check(cu_seq_q.numel() == cu_seq_k.numel() and cu_seq_q.numel() >= 2, "batch size must be positive")
    # What the kernel trusts and a wrong value would make silently wrong (it reads out of bounds): checked here.
    _check(int(cu_seq_q[-1]) == total_q and int(cu_seq_k[-1]) == k.shape[0], "cu_seqlens do not end at total")
    _check(isinstance(max_q, int) and isinstance(max_k, int), "max_q and max_k are host integers")
    _check(int((cu_seq_q[1:] - cu_seq_q[:-1]).max()) == max_q, "max_q is not the longest query sequence")


def _torch_varlen(form, q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, causal, scale=None, enable_gqa=False):
    """What torch's kernel computes (in fp32, the output in the inputs' dtype, as flash accumulates), after the
    checks its CUDA implementation makes."""
    check_flash_varlen_inputs(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k)
    assert cu_seq_q is cu_seq_k and max_q == max_k, "self-attention: the same segments for queries and keys"
    if not enable_gqa and k.shape[1] != q.shape[1]:  # varlen_attn's own check, before the kernel
        raise ValueError("Expect query and key/value to have the same number of heads; try enable_gqa=True")
    assert causal, "a causal LM must ask for causal attention"
    CALLS.append((form, cu_seq_q.numel() - 1))
    out = _segments(q.float(), k.float(), v.float(), cu_seq_q, scale, True)
    return out.to(q.dtype)


def _form_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    return _torch_varlen("2.10", query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal)


def _form_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    return _torch_varlen(
        "2.11", query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, tuple(window_size) == (-1, 0), scale
    )


def _form_2_12(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    return _torch_varlen(
        "2.12", query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, tuple(window_size) == (-1, 0), scale, enable_gqa
    )


# The keyword forms torch's varlen_attn has had (from its documentation): is_causal in the first release; scale and
# window_size next; enable_gqa, seqused_k, block_table and num_splits from 2.12.
TORCH_VARLEN_FORMS = {"2.10": _form_2_10, "2.11": _form_2_11, "2.12": _form_2_12}


def use_reference_torch_varlen(monkeypatch, form: str = "2.12") -> None:
    """Make ``torch.nn.attention.varlen.varlen_attn`` the exact reference under ``form``'s keywords, and let
    ``lightning_seqmem.training.attention`` run it on the CPU."""
    import torch.nn.attention.varlen as torch_varlen

    from lightning_seqmem.training import attention

    monkeypatch.setattr(torch_varlen, "varlen_attn", TORCH_VARLEN_FORMS[form])
    monkeypatch.setattr(attention, "_device_reason", lambda device: None)
    CALLS.clear()
