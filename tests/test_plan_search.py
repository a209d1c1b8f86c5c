"""seqmem-plan's fit search (issue 32.5) and the layer scaling that makes it fast (memory/layer_scaling.py).

Estimates that a test only needs as a yardstick (a budget between two configurations) come from ``cached_scaled``,
the search's own per-process cache, so the searches and the tests share their traces; what a test checks is traced
as the search traces it."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest

from lightning_seqmem.apps.plan_memory import MemoryPlan, plan_memory
from lightning_seqmem.apps.plan_report import format_fit, recommend
from lightning_seqmem.apps.plan_search import (
    ADAM8,
    BF16,
    CHECKPOINTING,
    CHUNKED,
    FSDP,
    LORA,
    QLORA,
    RunSettings,
    search_fit,
)
from lightning_seqmem.memory import fake_model, trace
from lightning_seqmem.memory.estimate import estimate_training_memory
from lightning_seqmem.memory.layer_scaling import (
    cached_scaled,
    parameter_counts,
    quantized_weight_bytes,
    scaled_training_memory,
)
from lightning_seqmem.memory.qlora_shape import quantize_linears
from lightning_seqmem.memory.stats import format_bytes
from lightning_seqmem.training.adapters import LoraSettings
from lightning_seqmem.training.building import build_model_config

PAD_KEYS = ("input_ids", "attention_mask", "labels")
PACK_KEYS = ("input_ids", "position_ids", "labels")


def tiny_llama(layers: int):
    """A tiny Llama of ``layers`` layers (untied head, so the loss layer is its own weight)."""
    fields = dict(model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=layers)
    fields.update(num_attention_heads=4, num_key_value_heads=2, vocab_size=3000, tie_word_embeddings=False)
    return build_model_config(fields, 3000, 0)


@pytest.fixture(scope="module")
def llama3():
    """Three layers: a first, a middle and a last one, the depth extended from traces of one and two."""
    return tiny_llama(3)


@pytest.fixture(scope="module")
def llama1():
    """One layer, for what does not depend on depth."""
    return tiny_llama(1)


@pytest.fixture(scope="module")
def mid():
    """A mid-size decoder for the search: 6 layers, a vocabulary whose full logits matter."""
    fields = dict(model_type="llama", hidden_size=128, intermediate_size=344, num_hidden_layers=6)
    fields.update(num_attention_heads=4, num_key_value_heads=2, vocab_size=8000, max_position_embeddings=1024)
    return build_model_config(fields, 8000, 0)


@pytest.mark.parametrize(
    "checkpointing, cross_entropy, precision, keys, lora, optimizer",
    [
        (False, "full", "bf16-mixed", PAD_KEYS, None, "adamw"),  # the plain step
        (True, "full", "32-true", PAD_KEYS, None, "adamw"),  # checkpointing: layers recomputed in backward
        (False, "chunked", "bf16-true", PACK_KEYS, None, "adamw_8bit"),  # the chunked loss, bitsandbytes' 8-bit AdamW
        (True, "chunked", "bf16-mixed", PAD_KEYS, None, "adamw"),
        (True, "chunked", "bf16-true", PAD_KEYS, LoraSettings(r=4), "adamw"),  # a LoRA adapter on a frozen base
        (False, "full", "bf16-mixed", PAD_KEYS, LoraSettings(r=4, quantize="nf4"), "adamw"),  # QLoRA's 4-bit base
    ],
)
@pytest.mark.slow
def test_scaled_from_one_and_two_layers_equals_the_full_trace(
    llama3, checkpointing, cross_entropy, precision, keys, lora, optimizer
):
    args = (llama3, 2, 64, keys, precision, "cuda", "sdpa", checkpointing)
    kwargs = dict(cross_entropy=cross_entropy, chunk_size=32, lora=lora, optimizer=optimizer)
    full = estimate_training_memory(*args, **kwargs)
    scaled = scaled_training_memory(*args, **kwargs)
    assert scaled.as_dict() == full.as_dict()  # to the byte: peak, phase, split at the peak, state, loss layer
    assert lora or parameter_counts(llama3)[0] == full.num_parameters
    if lora is not None and lora.quantize:  # the 4-bit base's bytes, extended from one and two layers too
        base = quantize_linears(fake_model.build_model(llama3, precision=precision))
        assert quantized_weight_bytes(llama3, precision) == sum(p.numel() * p.element_size() for p in base.parameters())


@pytest.mark.slow
def test_the_chunk_loop_traced_as_its_first_and_last_chunk_gives_every_chunk_s_peak(llama1, monkeypatch):
    args = (llama1, 3, 100, PAD_KEYS, "bf16-mixed", "cuda", "sdpa", False)
    trimmed = estimate_training_memory(*args, cross_entropy="chunked", chunk_size=16)  # 19 chunks, 2 traced
    monkeypatch.setattr(trace, "distinct_chunks_only", contextlib.nullcontext)
    every = estimate_training_memory(*args, cross_entropy="chunked", chunk_size=16)
    assert trimmed.as_dict() == every.as_dict()


def test_an_estimate_leaves_the_config_as_it_was(llama1):
    """transformers writes the dtype it builds in into the config: a bf16 estimate made the next fp32 one bf16."""
    args = (1, 32, PAD_KEYS)
    before = estimate_training_memory(llama1, *args, "32-true").peak
    estimate_training_memory(llama1, *args, "bf16-true")
    assert estimate_training_memory(llama1, *args, "32-true").peak == before


def _fit(run: RunSettings, budget: int):
    fit = search_fit(run, budget, margin=0.1)
    assert fit.fits, fit.message
    again = search_fit.__globals__["FitSearch"](run, fit.usable).estimate(fit.levers, fit.micro_batch_size)
    assert fit.estimate.peak == again.peak <= fit.usable  # the peak printed is that configuration's own
    assert format_bytes(fit.estimate.peak) in format_fit(fit)
    return fit


@pytest.mark.slow
def test_the_search_finds_a_configuration_that_fits_where_the_plain_run_does_not(mid):
    run = RunSettings(mid, 512, PAD_KEYS, "bf16-mixed", cross_entropy="full", micro_batch_size=8, device="cpu")
    plain = cached_scaled(mid, 8, 512, PAD_KEYS, "bf16-mixed", "cpu", cross_entropy="full")
    checkpointed = cached_scaled(mid, 8, 512, PAD_KEYS, "bf16-mixed", "cpu", gradient_checkpointing=True)
    budget = int(max(checkpointed.peak, plain.peak * 0.6) / 0.9)
    assert plain.peak > budget * 0.9
    fit = _fit(run, budget)
    assert fit.micro_batch_size == 8 and fit.levers and set(fit.levers) <= {CHUNKED, CHECKPOINTING}
    line = format_fit(fit)
    assert line.startswith("Fits: ") and "512 tokens" in line and "micro_batch_size=8" in line
    assert all(o in line for o in fit.overrides)
    # A budget too small for any lever at 8 rows: a smaller micro-batch, the tokens per step kept.
    one = cached_scaled(mid, 1, 512, PAD_KEYS, "bf16-true", "cpu", gradient_checkpointing=True, cross_entropy="chunked")
    small = _fit(run, int(one.peak / 0.9) + 1)
    assert small.micro_batch_size < 8 and BF16 in small.levers
    assert f"trainer.accumulate_grad_batches={8 // small.micro_batch_size}" in small.overrides


@pytest.mark.slow
def test_the_search_never_advises_what_the_run_has(mid):
    run = RunSettings(mid, 512, PAD_KEYS, "bf16-true", True, "chunked", micro_batch_size=8, device="cpu")
    one = cached_scaled(mid, 1, 512, PAD_KEYS, "bf16-true", "cpu", gradient_checkpointing=True, cross_entropy="chunked")
    fit = _fit(run, int(one.peak / 0.9) + 1)
    assert fit.levers == () and fit.micro_batch_size < 8
    assert not any("precision" in o or "checkpointing" in o or "cross_entropy" in o for o in fit.overrides)
    line = format_fit(fit)
    assert "bf16-true +" not in line and "checkpointing" not in line and "chunked loss" not in line


def test_fsdp_over_the_devices_shards_the_state(mid):
    run = RunSettings(mid, 256, PAD_KEYS, "bf16-true", True, "chunked", micro_batch_size=1, devices=4, device="cpu")
    one = cached_scaled(mid, 1, 256, PAD_KEYS, "bf16-true", "cpu", gradient_checkpointing=True, cross_entropy="chunked")
    state = sum(one.state.values())
    fit = _fit(run, int((one.peak - state * 0.5) / 0.9))  # needs at least half the state off this GPU
    assert fit.levers == (FSDP,) and "trainer.strategy=fsdp trainer.devices=4" in fit.overrides
    assert "FSDP over 4 GPUs" in format_fit(fit)


def test_a_budget_below_the_weights_alone_is_an_error_naming_the_option_and_the_fix(mid):
    quantized = quantized_weight_bytes(mid, "bf16-true")  # QLoRA's: the smallest weights any lever reaches
    assert quantized < 2 * parameter_counts(mid)[0]  # below the bf16 weights
    with pytest.raises(ValueError, match=r"plan\.gpu_memory=.*below the model's 4-bit \(QLoRA\) weights alone.*bigger"):
        search_fit(RunSettings(mid, 512, device="cpu"), quantized - 1, margin=0.0)
    # A run that cannot have QLoRA (its own adapter is already 4-bit: nothing smaller) says the same of its weights
    with pytest.raises(ValueError, match=r"4-bit \(QLoRA\) weights alone"):
        search_fit(RunSettings(mid, 512, device="cpu", lora=LoraSettings(quantize="nf4")), quantized - 1, margin=0.0)


@pytest.mark.slow
def test_nothing_fits_says_what_came_closest(mid):
    run = RunSettings(mid, 512, PAD_KEYS, "bf16-true", True, "chunked", micro_batch_size=1, device="cpu")
    fit = search_fit(run, int(quantized_weight_bytes(mid, "bf16-true") * 1.05), margin=0.0)
    assert not fit.fits and "Nothing fits" in fit.message and "data.max_length" in fit.message
    assert "Nothing fits" in format_fit(fit)


def test_recommended_names_the_chunked_loss_when_it_makes_it_fit():
    from lightning_seqmem.apps.plan_report import StrategyPlan

    plans = [StrategyPlan("Pack()", 512, 1.0, 100, 0, 1, 1, 1, (4, 512))]
    memory = MemoryPlan(512, 2**30, 0.1, fits={False: None, True: 4}, chunked_fits=2)
    choice, reason = recommend(plans, memory, 4, 512)
    assert choice["cross_entropy"] == "chunked" and choice["micro_batch_size"] == 2
    assert "cross_entropy='chunked'" in reason


def test_no_fit_advice_offers_nothing_unchecked(llama3):
    def estimate(rows, length, checkpointing):
        return cached_scaled(llama3, rows, length, PAD_KEYS, "bf16-true", "cpu", "sdpa", checkpointing)

    memory = plan_memory(estimate, 64, [1, 2], budget=2**20, margin=0.0)
    assert "No micro_batch_size fits" in memory.advice and "trainer.precision=bf16-true" not in memory.advice


def test_a_lora_adapter_when_nothing_cheaper_fits_and_never_when_the_run_has_one(mid):
    run = RunSettings(mid, 256, PAD_KEYS, "bf16-true", True, "chunked", micro_batch_size=1, device="cpu")
    adapted = cached_scaled(
        mid, 1, 256, PAD_KEYS, "bf16-true", "cpu", gradient_checkpointing=True, cross_entropy="chunked",
        lora=LoraSettings(),
    )  # fmt: skip
    fit = _fit(run, int(adapted.peak / 0.9) + 1)  # full fine-tuning's state does not fit this, even 8-bit
    assert fit.levers == (LORA,) and "+model/lora=default" in fit.overrides
    assert fit.estimate.peak == adapted.peak
    own = _fit(replace(run, lora=LoraSettings()), int(adapted.peak / 0.9) + 1)
    assert own.levers == () and not any("lora" in o for o in own.overrides)


def _yardstick(mid, **kwargs):
    return cached_scaled(
        mid, 1, 256, PAD_KEYS, "bf16-true", "cpu", gradient_checkpointing=True, cross_entropy="chunked", **kwargs
    )


def test_8bit_adamw_before_an_adapter_and_never_when_the_run_has_it(mid):
    run = RunSettings(mid, 256, PAD_KEYS, "bf16-true", True, "chunked", micro_batch_size=1, device="cpu")
    eight = _yardstick(mid, optimizer="adamw_8bit")
    assert eight.peak < _yardstick(mid).peak
    fit = _fit(run, int(eight.peak / 0.9) + 1)  # AdamW's bf16 moments do not fit this, 8-bit ones do
    assert fit.levers == (ADAM8,) and fit.overrides == ("model.optimizer=adamw_8bit",)
    assert fit.estimate.peak == eight.peak and "8-bit AdamW" in format_fit(fit)
    own = _fit(replace(run, optimizer="adamw_8bit"), int(eight.peak / 0.9) + 1)
    assert own.levers == () and own.overrides == () and own.estimate.peak == eight.peak


@pytest.mark.slow
def test_qlora_when_lora_does_not_fit_on_the_run_s_own_adapter_too(mid):
    run = RunSettings(mid, 256, PAD_KEYS, "bf16-true", True, "chunked", micro_batch_size=1, device="cpu")
    qlora = _yardstick(mid, lora=LoraSettings(quantize="nf4"))
    assert qlora.peak < _yardstick(mid, lora=LoraSettings()).peak  # the 4-bit base: LoRA's does not fit
    fit = _fit(run, int(qlora.peak / 0.9) + 1)
    assert fit.levers == (QLORA,) and fit.overrides == ("+model/lora=qlora",) and fit.estimate.peak == qlora.peak
    own = LoraSettings(r=8, target_modules=("q_proj", "v_proj"))
    mine = _fit(replace(run, lora=own), int(_yardstick(mid, lora=replace(own, quantize="nf4")).peak / 0.9) + 1)
    assert mine.levers == (QLORA,) and mine.overrides == ("model.lora.quantize=nf4",)  # the run's r and targets
    done = _fit(replace(run, lora=LoraSettings(quantize="nf4")), int(qlora.peak / 0.9) + 1)
    assert done.levers == () and done.overrides == ()


@pytest.mark.slow
def test_seqmem_plan_prints_the_fit_and_recommends_it_when_the_table_has_none():
    from hydra import compose, initialize_config_module

    from lightning_seqmem.apps.plan_app import plan_from_config
    from lightning_seqmem.apps.plan_report import format_plan

    # micro_batch_size=1: the search starts from the table's own first row, so the two share their traces
    overrides = ["model=tiny_llama", "data.max_length=128", "data.micro_batch_size=1", "plan.max_lengths=[128]"]
    overrides.append("plan.micro_batch_sizes=[1]")
    with initialize_config_module("lightning_seqmem.conf", version_base="1.3"):
        cfg = compose(
            "plan", overrides=[*overrides, "plan.device=cpu", "plan.precision=32-true", "plan.gpu_memory=8GiB"]
        )
        roomy, _ = plan_from_config(cfg)
    assert roomy.fit.fits and roomy.fit.levers == () and "Fits: " in format_plan(roomy)
    # A budget the configured run misses at micro_batch_size=1 but checkpointing or bf16 weights make.
    one = roomy.memory.estimates[False][1]
    tight = int((one.peak - one.state["optimizer_state"] // 2) / 0.9)
    with initialize_config_module("lightning_seqmem.conf", version_base="1.3"):
        cfg = compose("plan", overrides=[*overrides, "plan.device=cpu", "plan.precision=32-true"])
        cfg.plan.gpu_memory = tight
        result, _ = plan_from_config(cfg)
    text = format_plan(result)
    assert result.fit.fits and result.fit.estimate.peak <= result.fit.usable
    assert result.memory.fits[False] is None and result.recommended["micro_batch_size"] == result.fit.micro_batch_size
    recommended = text[text.index("Recommended:") :].splitlines()[0]
    named = ("precision=bf16-true", "gradient_checkpointing=True", "cross_entropy=chunked")
    assert any(choice in recommended for choice in named), recommended
    # A QLoRA run with the 8-bit optimizer: the table estimates that run, and the search advises neither again
    with initialize_config_module("lightning_seqmem.conf", version_base="1.3"):
        adapted = [*overrides, "plan.device=cpu", "plan.precision=32-true", "plan.gpu_memory=8GiB"]
        cfg = compose("plan", overrides=[*adapted, "+model/lora=qlora", "model.optimizer=adamw_8bit"])
        qlora, notes = plan_from_config(cfg)
    table = qlora.memory.estimates[False][1]
    model_config, keys = qlora.fit.settings.model_config, qlora.fit.settings.keys
    args = (model_config, 1, 128, keys, "32-true", "cpu", "sdpa", False)
    assert table == cached_scaled(*args, lora=LoraSettings(quantize="nf4"), optimizer="adamw_8bit")
    assert table.state["parameters"] < one.state["parameters"] and table.optimizer_state < one.optimizer_state
    assert qlora.fit.fits and qlora.fit.levers == () and qlora.fit.overrides == ()
    assert any("QLoRA r=16, 8-bit AdamW" in note for note in notes)
