"""seqmem-plan's fit search (issue 32.5) and the layer scaling that makes it fast (memory/layer_scaling.py)."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest

from lightning_seqmem.apps.plan_memory import MemoryPlan, plan_memory
from lightning_seqmem.apps.plan_report import format_fit, recommend
from lightning_seqmem.apps.plan_search import BF16, CHECKPOINTING, CHUNKED, FSDP, RunSettings, search_fit
from lightning_seqmem.memory import trace
from lightning_seqmem.memory.estimate import estimate_training_memory
from lightning_seqmem.memory.layer_scaling import parameter_counts, scaled_training_memory
from lightning_seqmem.memory.stats import format_bytes
from lightning_seqmem.training.adapters import LoraSettings
from lightning_seqmem.training.building import build_model_config

PAD_KEYS = ("input_ids", "attention_mask", "labels")
PACK_KEYS = ("input_ids", "position_ids", "labels")


@pytest.fixture(scope="module")
def llama4():
    """A 4-layer tiny Llama (untied head, so the loss layer is its own weight)."""
    fields = dict(model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=4)
    fields.update(num_attention_heads=4, num_key_value_heads=2, vocab_size=3000, tie_word_embeddings=False)
    return build_model_config(fields, 3000, 0)


@pytest.fixture(scope="module")
def mid():
    """A mid-size decoder for the search: 6 layers, a vocabulary whose full logits matter."""
    fields = dict(model_type="llama", hidden_size=128, intermediate_size=344, num_hidden_layers=6)
    fields.update(num_attention_heads=4, num_key_value_heads=2, vocab_size=8000, max_position_embeddings=1024)
    return build_model_config(fields, 8000, 0)


@pytest.mark.parametrize(
    "checkpointing, cross_entropy, precision, keys",
    [
        (False, "full", "bf16-mixed", PAD_KEYS),  # the plain step
        (True, "full", "32-true", PAD_KEYS),  # checkpointing: layers recomputed in backward
        (False, "chunked", "bf16-true", PACK_KEYS),  # the chunked loss
        (True, "chunked", "bf16-mixed", PAD_KEYS),
        (True, "chunked", "bf16-true", LoraSettings(r=4)),  # a LoRA adapter on a frozen base
    ],
)
def test_scaled_from_one_and_two_layers_equals_the_full_trace(llama4, checkpointing, cross_entropy, precision, keys):
    lora = keys if isinstance(keys, LoraSettings) else None
    args = (llama4, 2, 96, PAD_KEYS if lora else keys, precision, "cuda", "sdpa", checkpointing)
    full = estimate_training_memory(*args, cross_entropy=cross_entropy, chunk_size=64, lora=lora)
    scaled = scaled_training_memory(*args, cross_entropy=cross_entropy, chunk_size=64, lora=lora)
    assert scaled.as_dict() == full.as_dict()  # to the byte: peak, phase, split at the peak, state, loss layer
    assert lora or parameter_counts(llama4)[0] == full.num_parameters


def test_the_chunk_loop_traced_as_its_first_and_last_chunk_gives_every_chunk_s_peak(llama4, monkeypatch):
    args = (llama4, 3, 100, PAD_KEYS, "bf16-mixed", "cuda", "sdpa", False)
    trimmed = estimate_training_memory(*args, cross_entropy="chunked", chunk_size=16)  # 19 chunks, 2 traced
    monkeypatch.setattr(trace, "distinct_chunks_only", contextlib.nullcontext)
    every = estimate_training_memory(*args, cross_entropy="chunked", chunk_size=16)
    assert trimmed.as_dict() == every.as_dict()


def test_an_estimate_leaves_the_config_as_it_was(llama4):
    """transformers writes the dtype it builds in into the config: a bf16 estimate made the next fp32 one bf16."""
    args = (1, 32, PAD_KEYS)
    before = estimate_training_memory(llama4, *args, "32-true").peak
    estimate_training_memory(llama4, *args, "bf16-true")
    assert estimate_training_memory(llama4, *args, "32-true").peak == before


def _fit(run: RunSettings, budget: int):
    fit = search_fit(run, budget, margin=0.1)
    assert fit.fits, fit.message
    again = search_fit.__globals__["FitSearch"](run, fit.usable).estimate(fit.levers, fit.micro_batch_size)
    assert fit.estimate.peak == again.peak <= fit.usable  # the peak printed is that configuration's own
    assert format_bytes(fit.estimate.peak) in format_fit(fit)
    return fit


def test_the_search_finds_a_configuration_that_fits_where_the_plain_run_does_not(mid):
    run = RunSettings(mid, 512, PAD_KEYS, "bf16-mixed", cross_entropy="full", micro_batch_size=8, device="cpu")
    plain = scaled_training_memory(mid, 8, 512, PAD_KEYS, "bf16-mixed", "cpu", cross_entropy="full")
    checkpointed = scaled_training_memory(mid, 8, 512, PAD_KEYS, "bf16-mixed", "cpu", gradient_checkpointing=True)
    budget = int(max(checkpointed.peak, plain.peak * 0.6) / 0.9)
    assert plain.peak > budget * 0.9
    fit = _fit(run, budget)
    assert fit.micro_batch_size == 8 and fit.levers and set(fit.levers) <= {CHUNKED, CHECKPOINTING}
    line = format_fit(fit)
    assert line.startswith("Fits: ") and "512 tokens" in line and "micro_batch_size=8" in line
    assert all(o in line for o in fit.overrides)
    # A budget too small for any lever at 8 rows: a smaller micro-batch, the tokens per step kept.
    one = scaled_training_memory(
        mid, 1, 512, PAD_KEYS, "bf16-true", "cpu", gradient_checkpointing=True, cross_entropy="chunked"
    )
    small = _fit(run, int(one.peak / 0.9) + 1)
    assert small.micro_batch_size < 8 and BF16 in small.levers
    assert f"trainer.accumulate_grad_batches={8 // small.micro_batch_size}" in small.overrides


def test_the_search_never_advises_what_the_run_has(mid):
    run = RunSettings(mid, 512, PAD_KEYS, "bf16-true", True, "chunked", micro_batch_size=8, device="cpu")
    one = scaled_training_memory(
        mid, 1, 512, PAD_KEYS, "bf16-true", "cpu", gradient_checkpointing=True, cross_entropy="chunked"
    )
    fit = _fit(run, int(one.peak / 0.9) + 1)
    assert fit.levers == () and fit.micro_batch_size < 8
    assert not any("precision" in o or "checkpointing" in o or "cross_entropy" in o for o in fit.overrides)
    line = format_fit(fit)
    assert "bf16-true +" not in line and "checkpointing" not in line and "chunked loss" not in line


def test_fsdp_over_the_devices_shards_the_state(mid):
    run = RunSettings(mid, 256, PAD_KEYS, "bf16-true", True, "chunked", micro_batch_size=1, devices=4, device="cpu")
    one = scaled_training_memory(
        mid, 1, 256, PAD_KEYS, "bf16-true", "cpu", gradient_checkpointing=True, cross_entropy="chunked"
    )
    state = sum(one.state.values())
    fit = _fit(run, int((one.peak - state * 0.5) / 0.9))  # needs at least half the state off this GPU
    assert fit.levers == (FSDP,) and "trainer.strategy=fsdp trainer.devices=4" in fit.overrides
    assert "FSDP over 4 GPUs" in format_fit(fit)


def test_a_budget_below_the_weights_alone_is_an_error_naming_the_option_and_the_fix(mid):
    weights = 2 * parameter_counts(mid)[0]
    with pytest.raises(ValueError, match=r"plan\.gpu_memory=.*below the model's bf16 weights alone.*bigger plan"):
        search_fit(RunSettings(mid, 512, device="cpu"), weights - 1, margin=0.0)


def test_nothing_fits_says_what_came_closest(mid):
    run = RunSettings(mid, 512, PAD_KEYS, "bf16-true", True, "chunked", micro_batch_size=1, device="cpu")
    weights = 2 * parameter_counts(mid)[0]
    fit = search_fit(run, int(weights * 1.2), margin=0.0)
    assert not fit.fits and "Nothing fits" in fit.message and "data.max_length" in fit.message
    assert "Nothing fits" in format_fit(fit)


def test_recommended_names_the_chunked_loss_when_it_makes_it_fit():
    from lightning_seqmem.apps.plan_report import StrategyPlan

    plans = [StrategyPlan("Pack()", 512, 1.0, 100, 0, 1, 1, 1, (4, 512))]
    memory = MemoryPlan(512, 2**30, 0.1, fits={False: None, True: 4}, chunked_fits=2)
    choice, reason = recommend(plans, memory, 4, 512)
    assert choice["cross_entropy"] == "chunked" and choice["micro_batch_size"] == 2
    assert "cross_entropy='chunked'" in reason


def test_no_fit_advice_offers_nothing_unchecked(llama4):
    def estimate(rows, length, checkpointing):
        return scaled_training_memory(llama4, rows, length, PAD_KEYS, "bf16-true", "cpu", "sdpa", checkpointing)

    memory = plan_memory(estimate, 64, [1, 2], budget=2**20, margin=0.0)
    assert "No micro_batch_size fits" in memory.advice and "trainer.precision=bf16-true" not in memory.advice


def test_a_lora_adapter_when_nothing_cheaper_fits_and_never_when_the_run_has_one(mid):
    run = RunSettings(mid, 256, PAD_KEYS, "bf16-true", True, "chunked", micro_batch_size=1, device="cpu")
    adapted = scaled_training_memory(
        mid, 1, 256, PAD_KEYS, "bf16-true", "cpu", gradient_checkpointing=True, cross_entropy="chunked",
        lora=LoraSettings(),
    )  # fmt: skip
    fit = _fit(run, int(adapted.peak / 0.9) + 1)  # full fine-tuning's state does not fit this
    assert fit.levers == ("LoRA r=16",) and "+model/lora=default" in fit.overrides
    assert fit.estimate.peak == adapted.peak
    own = _fit(replace(run, lora=LoraSettings()), int(adapted.peak / 0.9) + 1)
    assert own.levers == () and not any("lora" in o for o in own.overrides)


def test_seqmem_plan_prints_the_fit_and_recommends_it_when_the_table_has_none():
    from hydra import compose, initialize_config_module

    from lightning_seqmem.apps.plan_app import plan_from_config
    from lightning_seqmem.apps.plan_report import format_plan

    overrides = ["model=tiny_llama", "data.max_length=128", "plan.max_lengths=[128]", "plan.micro_batch_sizes=[1,2]"]
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
