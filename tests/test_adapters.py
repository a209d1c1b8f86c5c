"""LoRA adapters through PEFT (training/adapters.py): settings checked by name, only the adapter trains, the adapter
saved in PEFT's format and loaded back by PEFT itself, merging, QLoRA refused where bitsandbytes cannot run.

The base is a tiny Llama built from a config (random weights, no download); PEFT's own ``PeftModel.from_pretrained``
and ``merge_and_unload`` are the oracle for the saved and merged adapter."""

import pytest
import torch

peft = pytest.importorskip("peft")

from lightning_seqmem.training.adapter_checkpoints import frozen_base_keys  # noqa: E402
from lightning_seqmem.training.adapters import (  # noqa: E402
    LoraSettings,
    apply_lora,
    check_quantization,
    merge_adapter,
    parameter_counts,
    quantized_load_kwargs,
    save_adapter,
    trainable_parameters,
)

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


def tiny_llama(seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY)).eval()


def batch(seed=1, rows=2, length=12):
    ids = torch.randint(0, 64, (rows, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def train_steps(model, steps=3):
    opt = torch.optim.AdamW([p for _, p in trainable_parameters(model)], lr=1e-2)
    model.train()
    for step in range(steps):
        loss = model(**batch(seed=step)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def test_only_adapter_parameters_require_grad():
    model = apply_lora(tiny_llama(), dict(r=4, alpha=8, dropout=0.0))
    names = [name for name, _ in trainable_parameters(model)]
    # "all-linear": the 7 linear layers of each of the 2 blocks, lora_A and lora_B each; not the LM head
    assert len(names) == 2 * 7 * 2 and all(".lora_A." in n or ".lora_B." in n for n in names)
    trainable, total = parameter_counts(model)
    assert 0 < trainable < total / 5


def test_training_changes_the_adapter_only():
    model = apply_lora(tiny_llama(), dict(r=4, alpha=8, dropout=0.0))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    train_steps(model)
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert changed == {name for name, _ in trainable_parameters(model)}
    assert all("lora_" in name for name in changed)


def test_target_module_list_adapts_those_only():
    model = apply_lora(tiny_llama(), dict(r=2, target_modules=["q_proj", "v_proj"]))
    layers = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name, _ in trainable_parameters(model)}
    assert layers == {"q_proj", "v_proj"}


def test_saved_adapter_loads_back_with_peft(tmp_path):
    model = train_steps(apply_lora(tiny_llama(seed=0), dict(r=4, alpha=8, dropout=0.0)))
    path = save_adapter(model, tmp_path / "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    loaded = peft.PeftModel.from_pretrained(tiny_llama(seed=0), path).eval()
    inputs = {"input_ids": batch()["input_ids"]}
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits)
        # the adapter changed the outputs: the load really brought it back
        assert not torch.allclose(tiny_llama(seed=0)(**inputs).logits, model(**inputs).logits)


def test_merge_gives_the_adapted_logits():
    model = train_steps(apply_lora(tiny_llama(), dict(r=4, alpha=8, dropout=0.0)))
    inputs = {"input_ids": batch()["input_ids"]}
    with torch.no_grad():
        adapted = model(**inputs).logits
        merged = merge_adapter(model)
        assert not isinstance(merged, peft.PeftModel) and type(merged).__name__ == "LlamaForCausalLM"
        assert not any("lora_" in name for name, _ in merged.named_parameters())
        torch.testing.assert_close(merged(**inputs).logits, adapted, rtol=1e-5, atol=1e-5)


def test_gradient_checkpointing_reaches_the_adapter():
    base = tiny_llama()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model = apply_lora(base, dict(r=4, dropout=0.0)).train()
    model(**batch()).loss.backward()
    assert all(p.grad is not None for _, p in trainable_parameters(model))


def test_frozen_base_keys_are_everything_but_the_adapter():
    holder = torch.nn.Module()
    holder.model = apply_lora(tiny_llama(), dict(r=2))
    holder.head = torch.nn.Linear(2, 2)  # outside the PEFT model: never dropped
    state = holder.state_dict()
    frozen = set(frozen_base_keys(holder, state))
    adapter = {name for name, _ in trainable_parameters(holder)}
    assert frozen == {key for key in state if key.startswith("model.")} - adapter
    assert "head.weight" not in frozen and adapter and not adapter & frozen
    assert frozen_base_keys(tiny_llama(), tiny_llama().state_dict()) == []


@pytest.mark.parametrize(
    "value, match",
    [
        (dict(r=0), r"lora.r=0 is not valid: the adapter's rank, an int >= 1"),
        (dict(r=2.5), r"lora.r=2.5"),
        (dict(alpha=0), r"lora.alpha=0 is not valid"),
        (dict(dropout=1.0), r"lora.dropout=1.0 is not valid: a number in \[0, 1\)"),
        (dict(rank=8), r"lora has unknown key\(s\) \['rank'\]; the LoRA settings are \['r', 'alpha'"),
        (dict(bias="some"), r"lora.bias='some' is not valid; use one of"),
        (dict(quantize="int4"), r"lora.quantize='int4' is not valid; use None .* or 'nf4'"),
        (dict(target_modules=[]), r"lora.target_modules=\[\] is not valid"),
    ],
)
def test_bad_settings_name_the_option(value, match):
    with pytest.raises(ValueError, match=match):
        LoraSettings.from_value(value)


def test_settings_from_a_mapping_and_not_from_other_things():
    settings = LoraSettings.from_value({"r": 8, "target_modules": ["q_proj", "v_proj"]})
    assert settings == LoraSettings(r=8, target_modules=("q_proj", "v_proj"))
    assert LoraSettings.from_value(None) is None and LoraSettings.from_value(settings) is settings
    assert LoraSettings.from_value({"target_modules": "q_proj"}).target_modules == ("q_proj",)
    with pytest.raises(TypeError, match=r"lora=16 is not valid: give a dict of LoRA settings"):
        LoraSettings.from_value(16)


def test_target_module_the_model_lacks_is_refused_with_the_ones_it_has():
    with pytest.raises(
        ValueError, match=r"lora.target_modules names \['query'\], which LlamaForCausalLM does not have"
    ):
        apply_lora(tiny_llama(), dict(target_modules=["q_proj", "query"]))
    with pytest.raises(ValueError, match=r"its linear layers are \['down_proj', 'gate_proj', 'k_proj', 'lm_head'"):
        apply_lora(tiny_llama(), dict(target_modules=["query"]))


def test_save_and_merge_need_a_peft_model(tmp_path):
    with pytest.raises(ValueError, match="save_adapter needs a PEFT model"):
        save_adapter(tiny_llama(), tmp_path)
    with pytest.raises(ValueError, match="merge_adapter needs a PEFT model"):
        merge_adapter(tiny_llama())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_qlora_refused_without_cuda():
    settings = LoraSettings(quantize="nf4")
    message = r"lora.quantize='nf4' \(QLoRA\) needs a CUDA device .* use lora.quantize=None \(plain LoRA"
    with pytest.raises(ValueError, match=message):
        check_quantization(settings)
    with pytest.raises(ValueError, match=message):
        quantized_load_kwargs(settings)
    with pytest.raises(ValueError, match=r"needs a base loaded in 4-bit"):
        apply_lora(tiny_llama(), settings)
    check_quantization(LoraSettings())  # plain LoRA: nothing to check


def test_missing_peft_says_how_to_install(monkeypatch):
    import sys

    from lightning_seqmem.training import adapters

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    with pytest.raises(ImportError, match=r"pip install lightning_seqmem\[peft\]"):
        adapters.import_peft()


def test_qlora_keeps_non_reentrant_checkpointing_and_casts_every_half_parameter_to_fp32():
    """PEFT's real ``prepare_model_for_kbit_training`` on a bf16 base with checkpointing on. Only the 4-bit load is
    stood in for (``is_loaded_in_4bit``: bitsandbytes runs on CUDA only); the layers stay plain ``nn.Linear``."""
    import warnings

    from lightning_seqmem.training.building import enable_checkpointing

    base = tiny_llama().to(torch.bfloat16)
    base.is_loaded_in_4bit = True
    enable_checkpointing(base)
    model = apply_lora(base, dict(r=4, alpha=8, dropout=0.0, quantize="nf4"))
    # Every parameter the 4-bit load leaves in half precision is fp32 now: norms, embeddings (tied head), adapter.
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    layers = model.get_base_model().model.layers
    assert all(layer.gradient_checkpointing for layer in layers)
    assert {layer._gradient_checkpointing_func.keywords["use_reentrant"] for layer in layers} == {False}
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when use_reentrant is left to its (reentrant) default
        model(**batch()).loss.backward()
    assert all(p.grad is not None for _, p in trainable_parameters(model))
