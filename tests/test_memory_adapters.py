"""The memory callbacks on a module of one's own wrapped with ``peft.get_peft_model`` (issue 32.4), and on
``CausalLM(lora=...)``: the traced estimate trains the adapter only (it failed before: PEFT moves its adapters with
``Module.to``, which fake parameters refuse), within 5 % of the same steps measured for real; ``CachePreallocator``
reserves the adapter's optimizer state only; ``ConfigChecks`` suggests an adapter for fp16 full fine-tuning."""

import lightning.pytorch as L
import pytest
import torch
from _memory_helpers import VOCAB, Probe, TinyData, TinyLM, assert_same, trainer

peft = pytest.importorskip("peft")

from lightning_seqmem import CausalLM  # noqa: E402
from lightning_seqmem.memory import checks  # noqa: E402
from lightning_seqmem.memory.estimate import estimate_training_memory, module_facts, shortfall_message  # noqa: E402
from lightning_seqmem.memory.fake_model import build_model  # noqa: E402
from lightning_seqmem.memory.measured import measured_peak_bytes  # noqa: E402
from lightning_seqmem.memory.preallocate import CachePreallocator  # noqa: E402
from lightning_seqmem.memory.trace import adamw, lightning_steps  # noqa: E402
from lightning_seqmem.memory.worst_batch import make_dummy_batch  # noqa: E402

LORA = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)


class PeftLM(TinyLM):
    """TinyLM with its Llama wrapped by ``peft.get_peft_model``, as a user would; AdamW over every parameter (the
    frozen ones get no gradient, so no state)."""

    def __init__(self, config=LORA):
        super().__init__()
        self.model = peft.get_peft_model(self.model, config)


def nbytes(params):
    return sum(p.numel() * p.element_size() for p in params)


def test_preallocator_reserves_the_adapters_optimizer_state_only(tmp_path):
    L.seed_everything(0)
    model = PeftLM()
    adapter = [p for p in model.parameters() if p.requires_grad]
    before, after, cb = Probe(), Probe(), CachePreallocator()
    trainer(tmp_path, [before, cb, after]).fit(model, datamodule=TinyData())
    assert_same(before.state, after.state)
    assert cb.report.optimizer_state == 2 * nbytes(adapter)  # exp_avg and exp_avg_sq of the adapter
    full = CachePreallocator()
    trainer(tmp_path, [full]).fit(TinyLM(), datamodule=TinyData())
    assert full.report.optimizer_state == 2 * nbytes(TinyLM().parameters()) > 10 * cb.report.optimizer_state


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_estimate_of_a_peft_module_trains_the_adapter_and_matches_the_measured_step(precision):
    model = PeftLM()
    facts = module_facts(model)
    assert facts["lora"].r == 4 and facts["lora"].target_modules  # what PEFT adapted, read back
    rows, length, keys = 2, 48, ("input_ids", "attention_mask", "labels")
    est = estimate_training_memory(rows=rows, length=length, keys=keys, device="cpu", precision=precision, **facts)
    size = 2 if precision == "bf16-true" else 4
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert est.state["gradients"] == adapter * size  # the adapter's gradients only, not the base's
    assert est.num_parameters == sum(p.numel() for p in model.parameters())
    assert adapter * 2 * size <= est.state["optimizer_state"] < adapter * 2 * size + 1024  # + step counters

    batch = make_dummy_batch(rows, length, keys, VOCAB)

    def run():
        torch.manual_seed(0)
        base = build_model(model.model.config, facts["attn_implementation"], precision)
        real = peft.get_peft_model(base, LORA, autocast_adapter_dtype=False).train()
        lightning_steps(real, adamw(real, "cpu"), batch, precision)

    measured = measured_peak_bytes(run)
    assert abs(est.peak - measured) <= 0.05 * measured, (est.peak, measured)


@pytest.mark.slow
def test_causal_lm_lora_and_a_users_peft_module_give_the_same_estimate():
    config = dict(
        model_type="llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    ours = CausalLM(model_config=config, vocab_size=VOCAB, lora=dict(r=4, alpha=8, dropout=0.0))
    users = CausalLM(model_config=config, vocab_size=VOCAB)
    users.model = peft.get_peft_model(users.model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    a, b = (estimate_training_memory(rows=2, length=32, device="cpu", **module_facts(m)) for m in (ours, users))
    assert a == b and a.gradients < a.parameters / 5


@pytest.mark.slow
def test_shortfall_suggests_an_adapter_for_full_fine_tuning_only():
    facts = module_facts(TinyLM())
    message = shortfall_message(shape=(2, 48), keys=("input_ids", "labels"), available=1, **facts)
    assert "a LoRA adapter (CausalLM(lora=dict(r=16)), or peft.get_peft_model)" in message
    adapted = shortfall_message(shape=(2, 48), keys=("input_ids", "labels"), available=1, **module_facts(PeftLM()))
    assert "LoRA" not in adapted


@pytest.mark.slow
def test_adapters_the_tracer_cannot_rebuild_are_not_estimated():
    ia3 = TinyLM()
    ia3.model = peft.get_peft_model(ia3.model, peft.IA3Config(target_modules=["k_proj"], feedforward_modules=[]))
    assert module_facts(ia3) is None  # nothing traced rather than a wrong number
    # QLoRA is traced on the 4-bit stand-in (memory/qlora_shape.py; tests/test_qlora_shape.py): it was refused
    config = TinyLM().model.config
    qlora = estimate_training_memory(config, 1, 16, device="cpu", lora=dict(r=4, quantize="nf4"))
    lora = estimate_training_memory(config, 1, 16, device="cpu", lora=dict(r=4))
    assert qlora.state["parameters"] < lora.state["parameters"] and qlora.gradients == lora.gradients


def test_config_checks_suggest_an_adapter_for_fp16_full_fine_tuning():
    run = L.Trainer(accelerator="cpu", precision="16-true", logger=False, enable_progress_bar=False)
    full = checks.find_problems(checks.gather_facts(run, TinyLM()))
    assert "CausalLM(lora=dict(r=16))" in full["fp16_full_finetuning"]
    assert "fp16_full_finetuning" not in checks.find_problems(checks.gather_facts(run, PeftLM()))
