"""QLoRA estimated anywhere (issue 32.2 and 32.6): the pure-torch memory model of bitsandbytes' 4-bit linear layer
(memory/qlora_shape.py) stores what bitsandbytes stores, keeps nothing dequantized for backward, and the traced
estimate of a QLoRA-shaped model equals the CPU profiler's peak of the same stand-in model training for real."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from lightning_seqmem.memory.estimate import estimate_training_memory  # noqa: E402
from lightning_seqmem.memory.fake_model import build_model  # noqa: E402
from lightning_seqmem.memory.measured import measured_training_peak, with_adapter  # noqa: E402
from lightning_seqmem.memory.qlora_shape import (  # noqa: E402
    Linear4bitShape,
    quantize_linears,
    quantized_state_bytes,
    stored_bytes,
)
from lightning_seqmem.memory.worst_batch import make_dummy_batch  # noqa: E402
from lightning_seqmem.training.adapters import LoraSettings  # noqa: E402
from lightning_seqmem.training.building import build_model_config  # noqa: E402

PAD_KEYS = ("input_ids", "attention_mask", "labels")
QLORA = LoraSettings(r=4, dropout=0.0, quantize="nf4")


@pytest.fixture(scope="module")
def config():
    fields = dict(model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=2)
    fields.update(num_attention_heads=4, num_key_value_heads=2, vocab_size=3000)
    return build_model_config(fields, 3000, 0)


def bnb_nf4_bytes(n: int, double_quant: bool) -> int:
    """bitsandbytes' quantize_4bit(blocksize=64, quant_type="nf4", compress_statistics=double_quant), written out:
    packed uint8 [(n+1)//2, 1]; absmax fp32 [ceil(n/64)], or nested: uint8 [blocks] + state2 (absmax fp32
    [ceil(blocks/256)], its 256-entry fp32 code, an fp32 offset); the 16-entry fp32 NF4 code."""
    blocks = -(-n // 64)
    nested = blocks + 4 * (-(-blocks // 256)) + 4 * 256 + 4 if double_quant else 4 * blocks
    return (n + 1) // 2 + nested + 16 * 4


@pytest.mark.parametrize("shape", [(4096, 14336), (896, 4864), (7, 9)])  # Llama-3-8B's MLP, Qwen's, a ragged block
@pytest.mark.parametrize("double_quant", [True, False])
def test_the_stand_in_stores_what_bitsandbytes_stores(shape, double_quant):
    out_features, in_features = shape
    with torch.device("meta"):  # the 8B shape's fp32 weight would take 235 MB for nothing
        linear = torch.nn.Linear(in_features, out_features, bias=False)
        layer = Linear4bitShape(linear, double_quant=double_quant)
    held = sum(p.numel() * p.element_size() for p in layer.parameters())
    assert (
        held
        == stored_bytes(out_features, in_features, double_quant)
        == bnb_nf4_bytes(shape[0] * shape[1], double_quant)
    )
    assert layer.weight.dtype == torch.uint8 and layer.weight.shape == ((shape[0] * shape[1] + 1) // 2, 1)
    assert not any(p.requires_grad for p in layer.parameters())


def test_forward_dequantizes_transiently_and_backward_keeps_no_dequantized_weight():
    layer = Linear4bitShape(torch.nn.Linear(64, 128, bias=True))
    x = torch.randn(3, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(x)
    assert out.shape == (3, 128) and out.dtype == x.dtype
    assert not [t for t in saved if t.shape == (128, 64)]  # bnb's MatMul4Bit saves the packed weight only
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape and layer.bias.grad is not None
    assert layer.weight.grad is None  # the 4-bit weight gets no gradient


def test_the_head_and_embeddings_stay_unquantized(config):
    model = quantize_linears(build_model(config))
    quantized = [name for name, m in model.named_modules() if isinstance(m, Linear4bitShape)]
    assert len(quantized) == 2 * 7 and not any("lm_head" in name for name in quantized)  # q k v o gate up down
    assert model.lm_head.weight.dtype == model.get_input_embeddings().weight.dtype == torch.float32
    linears = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, Linear4bitShape))
    assert quantized_state_bytes(model) < linears  # under a byte per value, against 4 in fp32


@pytest.mark.slow  # a real step of the stand-in per case (the stored bytes above stay in the inner loop)
@pytest.mark.parametrize(
    "precision, checkpointing",
    [
        ("bf16-true", True),  # QLoRA as the planner advises it: bf16 weights, checkpointing
        ("32-true", False),
        ("bf16-true", False),
        ("bf16-mixed", False),
    ],
)
def test_the_qlora_estimate_equals_the_measured_step_of_the_stand_in(config, precision, checkpointing):
    rows, length = 2, 64
    est = estimate_training_memory(config, rows, length, PAD_KEYS, precision, "cpu", "sdpa", checkpointing, lora=QLORA)
    real = with_adapter(quantize_linears(build_model(config, precision=precision)), QLORA, precision)
    held = sum(p.numel() * p.element_size() for p in real.parameters())
    adapter = sum(p.numel() * p.element_size() for p in real.parameters() if p.requires_grad)
    assert est.state["parameters"] == held and est.state["gradients"] == adapter  # the 4-bit base; the adapter trains
    batch = make_dummy_batch(rows, length, PAD_KEYS, 3000)
    measured = measured_training_peak(config, batch, precision, "sdpa", checkpointing, lora=QLORA)
    assert abs(est.peak - measured) <= 0.05 * measured, (est.peak, measured)
