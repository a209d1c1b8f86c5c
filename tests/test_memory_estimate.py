"""The fake-tensor memory estimate: closed-form state bytes, agreement with a real CPU step, monotone, clear errors."""

import sys
from pathlib import Path

import pytest
import torch

from lightning_seqmem.memory.adapter_trace import add_fake_lora
from lightning_seqmem.memory.estimate import cached_estimate, estimate_training_memory
from lightning_seqmem.memory.fake_model import build_fake_model
from lightning_seqmem.memory.measured import measured_training_peak
from lightning_seqmem.memory.optimizer_8bit import traced_optimizer
from lightning_seqmem.memory.precision import closed_form_state_bytes, normalize_precision
from lightning_seqmem.memory.trace import CATEGORIES, CUDA_GRANULE, TraceError, trace_training_steps
from lightning_seqmem.memory.worst_batch import make_dummy_batch
from lightning_seqmem.training.adapters import LoraSettings
from lightning_seqmem.training.building import build_model_config
from lightning_seqmem.training.linear_cross_entropy import DEFAULT_CHUNK_SIZE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from plan_accuracy import PACK_KEYS, PAD_KEYS  # noqa: E402

VOCAB = 512
SMALL = {
    "tiny_llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "tiny_gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=1024),
}


def config(arch: str):
    return build_model_config(SMALL[arch], VOCAB, 0)


def _estimate(cfg, rows, length, keys=PAD_KEYS, **kwargs):
    """``estimate_training_memory``, remembered per question for this process (``cached_estimate``, as the
    callbacks remember it): a shape that several tests here ask for is traced once."""
    return cached_estimate(cfg, rows, length, keys, **kwargs)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-true"])
def test_parameter_gradient_and_adamw_bytes_match_the_closed_form(precision):
    est = estimate_training_memory(config("tiny_llama"), 2, 32, precision=precision, device="cpu")
    n = len(list(_real_model("tiny_llama").parameters()))
    expected = closed_form_state_bytes(est.num_parameters, n, precision)
    assert dict(est.state) == expected
    per_param = 16 if precision.endswith("mixed") or precision == "32-true" else 8
    assert sum(expected.values()) - 4 * n == per_param * est.num_parameters
    # in the steady state the peak falls in the forward, with every gradient and all optimizer state alive
    assert est.peak_phase == "forward"
    assert (est.parameters, est.gradients, est.optimizer_state) == tuple(expected.values())
    assert est.parameters + est.gradients + est.optimizer_state + est.activations == est.peak


def _real_model(arch):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config(arch))


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gpt2"])
@pytest.mark.parametrize("rows,length", [(1, 64), (2, 128), (4, 96)])
def test_estimate_is_within_5_percent_of_a_real_cpu_step(arch, rows, length):
    est = _estimate(config(arch), rows, length, device="cpu")
    real = measured_training_peak(config(arch), make_dummy_batch(rows, length, PAD_KEYS, VOCAB))
    assert abs(est.peak - real) <= 0.05 * real, (est.peak, real)


@pytest.mark.parametrize(
    "precision, device, keys, checkpointing, settings",
    [
        ("bf16-mixed", "cuda", PAD_KEYS, True, dict(lora=LoraSettings(r=4, quantize="nf4"))),  # foreach AdamW
        ("bf16-true", "cpu", PACK_KEYS, False, dict(cross_entropy="chunked", chunk_size=32, lora=LoraSettings(r=4))),
        ("32-true", "cuda", PAD_KEYS, False, dict(optimizer="adamw_8bit")),  # 8-bit moments, the shared maps
    ],
)
def test_one_step_traced_from_the_steady_state_is_the_two_step_trace(precision, device, keys, checkpointing, settings):
    """The estimate traces one step after ``steady_state`` (what a first step leaves): the same peak, phase, split,
    state and loss layer as tracing both steps, the first included (small adapters under the 8-bit optimizer
    included: their fp32 moments need no quantization maps, which the stand-in made anyway in the first step)."""
    cfg = config("tiny_llama")
    rows, length = 2, 64
    est = estimate_training_memory(cfg, rows, length, keys, precision, device, "sdpa", checkpointing, **settings)
    mode, module = build_fake_model(cfg, "sdpa", precision, checkpointing)
    if "lora" in settings:
        module = add_fake_lora(mode, module, settings["lora"], precision)
    loss = (settings.get("cross_entropy", "full"), settings.get("chunk_size", DEFAULT_CHUNK_SIZE))
    granule = CUDA_GRANULE if device == "cuda" else 1
    batch = make_dummy_batch(rows, length, keys, VOCAB)  # real, made outside the mode, as the estimate makes it
    with mode:
        optimizer = traced_optimizer(module, device, settings.get("optimizer", "adamw"))
        two = trace_training_steps(module, optimizer, batch, precision, 2, granule, *loss)
    state = two.live_split()
    del state["activations"]
    assert (est.peak, est.peak_phase, est.loss_layer) == (two.peak, two.peak_phase, two.loss_layer())
    assert {c: getattr(est, c) for c in CATEGORIES} == two.split() and dict(est.state) == state


@pytest.mark.slow
def test_packed_eager_mixed_and_checkpointed_steps_agree_with_reality_too():
    cases = [
        dict(keys=PACK_KEYS),
        dict(attn_implementation="eager"),
        dict(precision="bf16-mixed"),
        dict(gradient_checkpointing=True),
    ]
    for case in cases:
        keys = case.pop("keys", PAD_KEYS)
        est = estimate_training_memory(config("tiny_llama"), 2, 128, keys, device="cpu", **case)
        real = measured_training_peak(config("tiny_llama"), make_dummy_batch(2, 128, keys, VOCAB), **case)
        assert abs(est.peak - real) <= 0.05 * real, (case, est.peak, real)


@pytest.mark.slow
def test_memory_grows_with_rows_and_length_and_checkpointing_saves_activations():
    cfg = config("tiny_gpt2")
    shapes = [(1, 64), (2, 64), (4, 64), (2, 32), (2, 128)]  # each traced once
    est = {shape: _estimate(cfg, *shape, device="cpu") for shape in shapes}
    by_rows = [est[r, 64].peak for r in (1, 2, 4)]
    by_length = [est[2, n].peak for n in (32, 64, 128)]
    assert by_rows == sorted(by_rows) and len(set(by_rows)) == 3
    assert by_length == sorted(by_length) and len(set(by_length)) == 3
    plain = est[2, 128]
    ckpt = _estimate(cfg, 2, 128, device="cpu", gradient_checkpointing=True)
    assert ckpt.activations < plain.activations and ckpt.state == plain.state


@pytest.mark.slow
def test_eager_attention_keeps_the_length_by_length_scores_and_sdpa_does_not():
    cfg = config("tiny_llama")
    rows, heads = 2, SMALL["tiny_llama"]["num_attention_heads"]

    sdpa = {n: _estimate(cfg, rows, n, device="cuda") for n in (128, 256)}  # each traced once
    eager = {n: _estimate(cfg, rows, n, device="cuda", attn_implementation="eager") for n in sdpa}
    extra = {n: eager[n].activations - sdpa[n].activations for n in sdpa}

    # eager keeps fp32 attention probabilities [rows, heads, length, length] (at least one layer's at the peak)
    assert extra[256] >= rows * heads * 256 * 256 * 4
    assert extra[256] > 3 * extra[128]  # quadratic, not linear
    flash = estimate_training_memory(cfg, rows, 256, device="cuda", attn_implementation="flash_attention_2")
    sdpa = sdpa[256]
    assert flash.activations < sdpa.activations  # no [rows, 1, length, length] mask at all
    # torch's varlen kernel is traced as flash (no mask); "auto" as its larger candidate, sdpa
    varlen = estimate_training_memory(cfg, rows, 256, device="cuda", attn_implementation="torch_varlen")
    auto = estimate_training_memory(cfg, rows, 256, device="cuda", attn_implementation="auto")
    assert (varlen.peak, auto.peak) == (flash.peak, sdpa.peak)


def test_cuda_estimate_rounds_to_the_allocator_granule_and_uses_foreach_adamw():
    cfg = config("tiny_llama")
    cpu = _estimate(cfg, 2, 128, device="cpu")  # the shapes other tests here trace: shared when in one process
    cuda = _estimate(cfg, 2, 128, device="cuda")
    assert cuda.state["parameters"] % 512 == 0 and cuda.state["parameters"] >= cpu.state["parameters"]
    assert cuda.peak > cpu.peak


def test_bad_arguments_say_what_is_wrong():
    cfg = config("tiny_llama")
    with pytest.raises(ValueError, match="rows and length"):
        estimate_training_memory(cfg, 0, 64)
    with pytest.raises(ValueError, match="precision"):
        normalize_precision("transformer-engine")
    with pytest.raises(ValueError, match="attn_implementation"):
        estimate_training_memory(cfg, 1, 8, attn_implementation="flex_magic")
    with pytest.raises(ValueError, match="device"):
        estimate_training_memory(cfg, 1, 8, device="tpu")


class _ValueDependent(torch.nn.Module):
    """A model whose forward needs tensor values (the tracer has shapes only)."""

    def __init__(self):
        super().__init__()
        self.vocab_size = VOCAB
        self.embed = torch.nn.Embedding(VOCAB, 8)

    def forward(self, input_ids, labels, use_cache=False, **kwargs):
        kept = self.embed(input_ids)[input_ids > 0]  # a data-dependent shape
        return type("Out", (), {"loss": kept.sum()})()


def test_a_model_the_tracer_cannot_run_raises_naming_the_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False)
    with mode:
        module = _ValueDependent()
    cfg = config("tiny_llama")
    with pytest.raises(TraceError, match=r"op aten\.\w+"):
        estimate_training_memory(cfg, 2, 8, ("input_ids", "labels"), device="cpu", model=(mode, module))


@pytest.mark.slow
def test_a_7b_llama_is_estimated_in_seconds_without_allocating_it():
    import psutil

    cfg = build_model_config(
        dict(
            model_type="llama",
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
        ),
        32000,
        0,
    )
    rss = psutil.Process().memory_info().rss
    est = estimate_training_memory(cfg, 1, 512, precision="bf16-mixed", device="cuda")
    assert 6.7e9 < est.num_parameters < 6.8e9
    assert est.state["parameters"] >= 4 * est.num_parameters and est.peak > 16 * est.num_parameters
    assert psutil.Process().memory_info().rss - rss < 2 * 2**30  # 100+ GiB estimated, nothing like it allocated


def test_measured_peak_on_cpu_is_the_default_device():
    batch = make_dummy_batch(2, 32, PAD_KEYS, VOCAB)
    default = measured_training_peak(config("tiny_llama"), batch)
    on_cpu = measured_training_peak(config("tiny_llama"), batch, device=torch.device("cpu"))
    assert abs(on_cpu - default) <= 0.01 * default
    assert default > sum(p.numel() for p in _real_model("tiny_llama").parameters()) * 16  # weights, grads, AdamW
