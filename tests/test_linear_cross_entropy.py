"""The chunked LM head + cross-entropy equals the full path (``F.cross_entropy`` on ``hidden @ W.T``) in value and
gradients, for every reduction, chunk boundary, ignored label, head option and precision, without its memory."""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from lightning_seqmem.memory.measured import measured_peak_bytes
from lightning_seqmem.training import linear_cross_entropy as lce
from lightning_seqmem.training.liger_cross_entropy import liger_linear_cross_entropy
from lightning_seqmem.training.linear_cross_entropy import linear_cross_entropy, linear_token_logps

ROWS, LENGTH, HIDDEN, VOCAB = 2, 7, 16, 50
TOKENS = ROWS * LENGTH


def full_logits(hidden, weight, bias=None, scale=None, cap=None):
    """The full path's logits, the reference: ``softcap((hidden @ W.T + b) * scale)``."""
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias
    if scale is not None:
        logits = logits * scale
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    return logits


def full_cross_entropy(hidden, weight, labels, reduction="mean", bias=None, scale=None, cap=None):
    logits = full_logits(hidden, weight, bias, scale, cap).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction=reduction).view(
        labels.shape if reduction == "none" else ()
    )


def inputs(seed=0, bias=False, ignored=True):
    """``[2, 7, 16]`` hidden states, a ``[50, 16]`` head (and bias), labels with ignored positions."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, LENGTH, HIDDEN, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, generator=g).requires_grad_()
    labels = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
    if ignored:
        labels[0, :3] = -100  # a prompt
        labels[1, -2:] = -100  # padding
    return hidden, weight, (torch.randn(VOCAB, generator=g).requires_grad_() if bias else None), labels


def assert_matches_full(chunked, hidden, weight, bias, labels, reduction="mean", scale=None, cap=None, **kwargs):
    """``chunked(...)`` and the full path give the same loss and the same gradients (hidden, weight, bias) for a
    random upstream gradient, within 1e-5 (fp32)."""
    params = [t for t in (hidden, weight, bias) if t is not None]
    options = dict(reduction=reduction, head_bias=bias, logit_scale=scale, final_logit_softcapping=cap)
    out = chunked(hidden, weight, labels, **options, **kwargs)
    ref = full_cross_entropy(hidden, weight, labels, reduction, bias, scale, cap)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    upstream = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * upstream).sum(), params)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), params)
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk_size", [1, 3, TOKENS, TOKENS + 5])
def test_loss_and_gradients_match_the_full_path(reduction, chunk_size):
    """3-D inputs, ignored labels, a bias; chunk sizes of one token, one that divides nothing, all, more than all."""
    hidden, weight, bias, labels = inputs(bias=True)
    assert_matches_full(linear_cross_entropy, hidden, weight, bias, labels, reduction, chunk_size=chunk_size)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_ignored_label_and_flat_inputs(reduction):
    hidden, weight, _, labels = inputs(ignored=False)
    flat = hidden.detach().reshape(TOKENS, HIDDEN).requires_grad_()
    assert_matches_full(linear_cross_entropy, flat, weight, None, labels.reshape(-1), reduction, chunk_size=4)


@pytest.mark.parametrize(("scale", "cap"), [(0.25, None), (None, 3.0), (2.0, 5.0)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_logit_scale_and_soft_capping_are_applied_per_chunk(scale, cap, reduction):
    """The head's scale and Gemma's soft-capping (applied after it) give the reference's loss and gradients; the
    capped loss differs from the uncapped one, so the cap is really applied."""
    hidden, weight, bias, labels = inputs(bias=True)
    assert_matches_full(linear_cross_entropy, hidden, weight, bias, labels, reduction, scale, cap, chunk_size=3)
    capped = linear_cross_entropy(hidden, weight, labels, logit_scale=scale, final_logit_softcapping=cap)
    assert not torch.allclose(capped, linear_cross_entropy(hidden, weight, labels))


def test_tied_embeddings_accumulate_both_uses():
    """The same Parameter as input embedding and head: its gradient is the sum of both uses, as in the full path."""
    g = torch.Generator().manual_seed(0)
    embedding = torch.nn.Embedding(VOCAB, HIDDEN)
    mix = torch.nn.Linear(HIDDEN, HIDDEN)
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100

    def grads(loss_fn):
        embedding.zero_grad(), mix.zero_grad()
        hidden = torch.tanh(mix(embedding(ids)))
        loss_fn(hidden, embedding.weight, labels).backward()
        return embedding.weight.grad.clone(), mix.weight.grad.clone()

    chunked = grads(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_size=5))
    full = grads(full_cross_entropy)
    for got, want in zip(chunked, full):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert chunked[0][ids[0, 0]].abs().sum() > 0  # the embedding's own use reached the tied weight


def test_all_labels_ignored_is_what_cross_entropy_gives():
    """No trained token: mean NaN with zero gradients (not NaN ones), sum 0, none all zeros."""
    hidden, weight, _, labels = inputs()
    labels = torch.full_like(labels, -100)
    mean = linear_cross_entropy(hidden, weight, labels)
    assert mean.isnan()
    assert all(g.abs().sum() == 0 for g in torch.autograd.grad(mean, (hidden, weight)))
    assert linear_cross_entropy(hidden, weight, labels, reduction="sum") == 0
    assert (linear_cross_entropy(hidden, weight, labels, reduction="none") == 0).all()


def test_frozen_head_and_no_grad():
    """Only what needs a gradient gets one (a frozen head: no weight gradient computed); under ``no_grad`` (a
    reference model, validation) the same loss."""
    hidden, weight, _, labels = inputs()
    weight.requires_grad_(False)
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=4)
    (grad,) = torch.autograd.grad(loss, hidden)
    ref = full_cross_entropy(hidden, weight, labels)
    torch.testing.assert_close(grad, torch.autograd.grad(ref, hidden)[0], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(hidden, weight, labels), ref.detach())


def test_bf16_autocast_computes_the_loss_in_fp32():
    """Under bf16 autocast the matmuls run in bf16 as the full path's do, the loss is fp32, close to the fp32
    reference and equal to the full path under the same autocast within bf16 rounding; gradients in the
    parameters' dtype."""
    hidden, weight, bias, labels = inputs(bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_cross_entropy(hidden, weight, labels, head_bias=bias, chunk_size=3)
        autocast_ref = full_cross_entropy(hidden, weight, labels, bias=bias)
    assert out.dtype == torch.float32
    fp32_ref = full_cross_entropy(hidden, weight, labels, bias=bias)
    torch.testing.assert_close(out, fp32_ref, rtol=2e-2, atol=0)
    torch.testing.assert_close(out, autocast_ref, rtol=1e-2, atol=0)
    grads = torch.autograd.grad(out, (hidden, weight, bias))
    assert [g.dtype for g in grads] == [torch.float32] * 3
    for got, want in zip(grads, torch.autograd.grad(fp32_ref, (hidden, weight, bias))):
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.02 * want.abs().max().item())


def test_bf16_parameters_get_bf16_gradients():
    """A model in bf16 without autocast: loss in fp32, gradients in bf16 (accumulated in fp32 across chunks)."""
    hidden, weight, _, labels = inputs()
    hidden16 = hidden.detach().bfloat16().requires_grad_()
    weight16 = weight.detach().bfloat16().requires_grad_()
    out = linear_cross_entropy(hidden16, weight16, labels, chunk_size=3)
    assert out.dtype == torch.float32
    grads = torch.autograd.grad(out, (hidden16, weight16))
    assert [g.dtype for g in grads] == [torch.bfloat16] * 2
    ref = full_cross_entropy(hidden16, weight16, labels)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, torch.autograd.grad(ref, (hidden16, weight16))):
        torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02 * want.abs().max().item())


def test_negative_control_catches_a_chunk_boundary_bug_and_shifted_labels(monkeypatch):
    """The comparison the tests above rely on fails when a chunk loses its last token's loss (a boundary bug) or
    when the labels are off by one position: it can see the errors it is there to catch."""
    hidden, weight, bias, labels = inputs(bias=True)
    chunk_softmax = lce._chunk_softmax

    def drops_last_token(*args):
        losses, probs, tanh = chunk_softmax(*args)
        return torch.cat([losses[:-1], losses.new_zeros(1)]), probs, tanh

    monkeypatch.setattr(lce, "_chunk_softmax", drops_last_token)
    with pytest.raises(AssertionError):
        assert_matches_full(linear_cross_entropy, hidden, weight, bias, labels, chunk_size=3)
    monkeypatch.undo()
    assert_matches_full(linear_cross_entropy, hidden, weight, bias, labels, chunk_size=3)

    def shifted(h, w, y, **kwargs):
        return linear_cross_entropy(h, w, torch.cat([y[:, 1:], y[:, :1]], dim=1), **kwargs)

    with pytest.raises(AssertionError):
        assert_matches_full(shifted, hidden, weight, bias, labels, chunk_size=3)


@pytest.mark.slow
def test_peak_memory_is_far_below_the_full_path():
    """Forward and backward at vocabulary 32,000 and 2,048 tokens (hidden 16, so the logits dominate): the full
    path holds several ``[2048, 32000]`` fp32 tensors (250 MiB each) at once, the chunked one a ``[512, 32000]``
    buffer; measured with ``torch.profiler``'s allocation events."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2048, 16, generator=g, requires_grad=True)
    weight = torch.randn(32000, 16, generator=g).requires_grad_()
    labels = torch.randint(0, 32000, (2048,), generator=g)
    logits_bytes = 2048 * 32000 * 4

    full = measured_peak_bytes(lambda: full_cross_entropy(hidden, weight, labels).backward())
    chunked = measured_peak_bytes(lambda: linear_cross_entropy(hidden, weight, labels, chunk_size=512).backward())
    assert full >= 2 * logits_bytes
    assert chunked < logits_bytes / 3
    assert chunked * 8 < full


@pytest.mark.parametrize(("scale", "cap"), [(None, None), (0.5, 4.0)])
def test_token_logps_equal_the_gathered_log_softmax(scale, cap):
    """``linear_token_logps``: the target's log-probability under the full log-softmax, and its gradients for a
    per-token upstream gradient (what DPO's per-sequence sums give)."""
    hidden, weight, bias, labels = inputs(bias=True, ignored=False)
    hidden, targets = hidden.detach().reshape(TOKENS, HIDDEN).requires_grad_(), labels.reshape(-1)
    out = linear_token_logps(hidden, weight, targets, chunk_size=4, head_bias=bias, logit_scale=scale,
                             final_logit_softcapping=cap)  # fmt: skip
    logits = full_logits(hidden, weight, bias, scale, cap).float()
    ref = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)
    upstream = torch.randn(TOKENS, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((out * upstream).sum(), (hidden, weight, bias))
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (hidden, weight, bias))
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_model_gives_the_same_loss_without_recompiling():
    """Inside ``torch.compile`` (AOTAutograd, the part of the stack that handles autograd functions; inductor
    only adds code generation and takes minutes on CPU): the same loss and gradients, and a second batch with another
    number of trained tokens does not recompile."""
    import torch._dynamo

    torch._dynamo.reset()
    hidden, weight, _, _ = inputs()
    mix = torch.nn.Linear(HIDDEN, HIDDEN)

    def step(x, y, loss_fn):
        return loss_fn(torch.tanh(mix(x)), weight, y)

    compiled = torch.compile(lambda x, y: step(x, y, lambda h, w, t: linear_cross_entropy(h, w, t, chunk_size=3)),
                             backend="aot_eager")  # fmt: skip
    with torch._dynamo.config.patch(error_on_recompile=True):
        for ignored in (2, 5):
            labels = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(ignored))
            labels[:, :ignored] = -100
            out = compiled(hidden, labels)
            ref = step(hidden, labels, full_cross_entropy)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            got = torch.autograd.grad(out, (weight, mix.weight))
            for g, want in zip(got, torch.autograd.grad(ref, (weight, mix.weight))):
                torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("chunk_size", [0, -4, 2.5, True, "512"])
def test_bad_chunk_size_is_refused(chunk_size):
    hidden, weight, _, labels = inputs()
    with pytest.raises(ValueError, match=r"chunk_size=.*int >= 1.*use e\.g\. chunk_size=512"):
        linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_size)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_token_logps(hidden[0], weight, labels[0].clamp(min=0), chunk_size=chunk_size)


def test_bad_reduction_and_shapes_are_refused():
    hidden, weight, _, labels = inputs()
    with pytest.raises(ValueError, match=r"reduction='avg' is not valid; use one of \('mean', 'sum', 'none'\)"):
        linear_cross_entropy(hidden, weight, labels, reduction="avg")
    with pytest.raises(ValueError, match=r"head_weight \(16, 50\) must be \[vocab, hidden\]"):
        linear_cross_entropy(hidden, weight.T, labels)
    with pytest.raises(ValueError, match=r"labels \(7, 2\) must have hidden_states' shape"):
        linear_cross_entropy(hidden, weight, labels.T)
    with pytest.raises(ValueError, match="final_logit_softcapping=0"):
        linear_cross_entropy(hidden, weight, labels, final_logit_softcapping=0)


def test_liger_is_refused_without_the_package_or_without_cuda(monkeypatch):
    """Liger-Kernel is not installed here: the message names the install command; with a stand-in package on CPU
    tensors, the message names the CUDA device. (Liger itself is compared on a GPU by ``benchmarks/loss.py``.)"""
    hidden, weight, _, labels = inputs()
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # importing it raises ImportError
    with pytest.raises(ImportError, match=r"pip install liger-kernel.*cross_entropy='chunked'"):
        liger_linear_cross_entropy(hidden, weight, labels)

    stand_in = types.ModuleType("liger_kernel.transformers.fused_linear_cross_entropy")
    stand_in.LigerFusedLinearCrossEntropyLoss = object
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, stand_in.__name__, stand_in)
    with pytest.raises(ValueError, match=r"CUDA device only .* on cpu: move the model to a CUDA device"):
        liger_linear_cross_entropy(hidden, weight, labels)


def test_scalar_loss_backpropagates_once():
    """The summed loss's gradients are scaled in place (no second ``[vocab, hidden]`` tensor): a second backward
    through the same graph is refused with the way out, instead of giving twice-scaled gradients."""
    hidden, weight, _, labels = inputs()
    loss = linear_cross_entropy(hidden, weight, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagates once.*reduction='none'"):
        loss.backward()


def test_shifted_views_of_a_causal_lm():
    """``hidden[:, :-1]`` against ``labels[:, 1:]`` (non-contiguous views, as a causal LM passes them)."""
    hidden, weight, bias, labels = inputs(bias=True)
    assert not hidden[:, :-1].is_contiguous()
    for reduction in ("mean", "none"):
        assert_matches_full(linear_cross_entropy, hidden[:, :-1], weight, bias, labels[:, 1:], reduction, chunk_size=4)
