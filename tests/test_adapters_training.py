"""LoRA wired into the models: ``CausalLM(lora=...)`` and ``DPO`` with an adapter, through a real Trainer.

Only the adapter is in the optimizer and changes; a checkpoint of a ``pretrained_path`` base keeps the adapter and its
optimizer state and leaves the base out (it is loaded from there again); ``SaveAdapter`` writes what PEFT's own
``PeftModel.from_pretrained`` loads; DPO's reference is the base with the adapter disabled, no copy. The base is a
tiny Llama (random weights, saved with ``save_pretrained`` where a ``pretrained_path`` is needed; no download)."""

import datasets
import lightning.pytorch as pl
import pytest
import torch

peft = pytest.importorskip("peft")

from lightning_seqmem import DPO, CausalLM, SeqMemDataModule  # noqa: E402
from lightning_seqmem.training.adapter_checkpoints import BASE_RECORD  # noqa: E402
from lightning_seqmem.training.adapter_export import SaveAdapter  # noqa: E402
from lightning_seqmem.training.adapters import merge_adapter  # noqa: E402

VOCAB = 64
TINY = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=True,
)
LORA = dict(r=4, alpha=8, dropout=0.0)


def token_rows(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return datasets.Dataset.from_dict(
        {
            "input_ids": [
                torch.randint(1, VOCAB, (int(torch.randint(8, 30, (1,), generator=g)),), generator=g).tolist()
                for _ in range(n)
            ]
        }
    )


def text_dm(tmp_path):
    return SeqMemDataModule(token_rows(), max_length=32, micro_batch_size=4, pad_token_id=0, cache_dir=tmp_path / "c")


def pair_dm(tmp_path):
    rows = [
        {"prompt_ids": [5 + i % 7, 6], "chosen_ids": [7, 8 + i % 5], "rejected_ids": [9 + i % 3]} for i in range(24)
    ]
    return SeqMemDataModule(
        datasets.Dataset.from_list(rows), max_length=16, micro_batch_size=4, pad_token_id=0, cache_dir=tmp_path / "p"
    )


def trainer(tmp_path, **kwargs):
    kwargs = {"max_steps": 3, "limit_val_batches": 0, **kwargs}
    return pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kwargs,
    )


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    fields = dict(TINY)
    config = AutoConfig.for_model(fields.pop("model_type"), vocab_size=VOCAB, pad_token_id=0, **fields)
    path = tmp_path_factory.mktemp("base")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def base_model(base_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True).eval()


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


def test_only_the_adapter_is_optimized_and_changes(tmp_path):
    torch.manual_seed(0)
    model = CausalLM(model_config=TINY, vocab_size=VOCAB, lora=LORA, learning_rate=1e-2)
    assert isinstance(model.model, peft.PeftModel)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer(tmp_path).fit(model, datamodule=text_dm(tmp_path))
    adapter = {name for name, p in model.named_parameters() if p.requires_grad}
    assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter)
    in_optimizer = {id(p) for group in model.trainer.optimizers[0].param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for name, p in model.named_parameters() if name in adapter}
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert changed == adapter


def test_checkpoint_keeps_adapter_and_optimizer_state_and_leaves_the_pretrained_base_out(tmp_path, base_dir):
    model = CausalLM(pretrained_path=base_dir, lora=LORA, learning_rate=1e-2)
    fit = trainer(tmp_path, enable_checkpointing=False)
    fit.fit(model, datamodule=text_dm(tmp_path))
    path = tmp_path / "lora.ckpt"
    fit.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=False)
    adapter = {name for name, p in model.named_parameters() if p.requires_grad}
    model_keys = {key for key in ckpt["state_dict"] if key.startswith("model.")}
    assert model_keys == adapter  # the adapter, not a second copy of the base
    assert set(ckpt[BASE_RECORD]) == set(model.state_dict()) - adapter - {"_real_tokens"} - {
        key for key in model.state_dict() if not key.startswith("model.")
    }
    state = ckpt["optimizer_states"][0]["state"]
    assert len(state) == len(adapter) and all(v["exp_avg"].numel() < 32 * 64 for v in state.values())
    # load_from_checkpoint rebuilds the base from pretrained_path and the adapter from the checkpoint
    loaded = CausalLM.load_from_checkpoint(path).eval()
    torch.testing.assert_close(logits(loaded.model, IDS), logits(model.eval().model, IDS))
    # and a resumed fit goes on from there
    resumed = CausalLM(pretrained_path=base_dir, lora=LORA, learning_rate=1e-2)
    again = trainer(tmp_path, max_steps=4, enable_checkpointing=False)
    again.fit(resumed, datamodule=text_dm(tmp_path), ckpt_path=path)
    assert again.global_step == 4


def test_random_base_stays_in_the_checkpoint_once(tmp_path):
    """Without pretrained_path the base exists nowhere else: it is kept (once; frozen, so no optimizer state)."""
    model = CausalLM(model_config=TINY, vocab_size=VOCAB, lora=LORA)
    fit = trainer(tmp_path, max_steps=1, enable_checkpointing=False)
    fit.fit(model, datamodule=text_dm(tmp_path))
    fit.save_checkpoint(tmp_path / "r.ckpt")
    ckpt = torch.load(tmp_path / "r.ckpt", weights_only=False)
    assert BASE_RECORD not in ckpt and set(model.state_dict()) <= set(ckpt["state_dict"]) | {"_real_tokens"}
    assert len(ckpt["optimizer_states"][0]["state"]) == sum(p.requires_grad for p in model.parameters())
    loaded = CausalLM.load_from_checkpoint(tmp_path / "r.ckpt").eval()
    torch.testing.assert_close(logits(loaded.model, IDS), logits(model.eval().model, IDS))


def test_save_adapter_at_fit_end_loads_with_peft_and_merges(tmp_path, base_dir):
    model = CausalLM(pretrained_path=base_dir, lora=LORA, learning_rate=1e-2)
    callback = SaveAdapter(tmp_path / "adapter")
    trainer(tmp_path, enable_checkpointing=False, callbacks=[callback]).fit(model, datamodule=text_dm(tmp_path))
    assert callback.saved_to == str(tmp_path / "adapter")
    expected = logits(model.eval().model, IDS)
    loaded = peft.PeftModel.from_pretrained(base_model(base_dir), callback.saved_to).eval()
    torch.testing.assert_close(logits(loaded, IDS), expected)
    assert not torch.allclose(logits(base_model(base_dir), IDS), expected)  # the adapter trained
    torch.testing.assert_close(logits(merge_adapter(model.model), IDS), expected, rtol=1e-5, atol=1e-5)


def test_save_adapter_default_folder_and_warning_without_adapter(tmp_path):
    callback = SaveAdapter()
    trainer(tmp_path, max_steps=1, enable_checkpointing=False, callbacks=[callback]).fit(
        CausalLM(model_config=TINY, vocab_size=VOCAB, lora=LORA), datamodule=text_dm(tmp_path)
    )
    assert callback.saved_to == str(tmp_path / "adapter") and (tmp_path / "adapter" / "adapter_config.json").exists()
    with pytest.warns(UserWarning, match="holds no PEFT model"):
        trainer(tmp_path, max_steps=1, enable_checkpointing=False, callbacks=[SaveAdapter(tmp_path / "x")]).fit(
            CausalLM(model_config=TINY, vocab_size=VOCAB), datamodule=text_dm(tmp_path)
        )
    assert not (tmp_path / "x").exists()


def test_chunked_loss_through_the_adapter_equals_the_full_loss():
    torch.manual_seed(0)
    full = CausalLM(model_config=TINY, vocab_size=VOCAB, lora=LORA, cross_entropy="full")
    chunked = CausalLM(model_config=TINY, vocab_size=VOCAB, lora=LORA, cross_entropy="chunked", loss_chunk_size=5)
    chunked.load_state_dict(full.state_dict())
    with torch.no_grad():  # a non-zero adapter, so that the check sees it
        for a, b in zip(full.model.parameters(), chunked.model.parameters()):
            if a.requires_grad:
                a.normal_(0, 0.1), b.copy_(a)
    batch = {"input_ids": IDS, "labels": IDS}
    losses = [m.loss(batch) for m in (full, chunked)]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for loss in losses:
        loss.backward()
    grads = [[p.grad for p in m.parameters() if p.requires_grad] for m in (full, chunked)]
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_chunked_loss_refuses_an_adapter_on_the_head():
    lora = dict(r=2, target_modules=["q_proj", "lm_head"])
    model = CausalLM(model_config=TINY, vocab_size=VOCAB, lora=lora, cross_entropy="chunked")
    with pytest.raises(ValueError, match="LoRA adapter on the LM head is not applied by the chunked loss"):
        model.loss({"input_ids": IDS, "labels": IDS})


@pytest.mark.parametrize("cross_entropy", ["full", "chunked"])
def test_dpo_reference_is_the_base_with_the_adapter_disabled(tmp_path, base_dir, cross_entropy):
    model = DPO(pretrained_path=base_dir, lora=LORA, learning_rate=5e-2, cross_entropy=cross_entropy)
    dm = pair_dm(tmp_path)
    trainer(tmp_path, max_steps=4, enable_checkpointing=False).fit(model, datamodule=dm)
    assert model.reference_model is None  # no copy
    # one copy of the base weights: the module holds the base and the adapter, nothing more
    base = base_model(base_dir)
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in base.parameters()) + adapter
    batch = next(iter(dm.train_dataloader()))
    model.train()
    reference = model.reference_logps(batch)
    assert all(model.model.base_model.active_adapters) and model.model.training  # adapter back on, mode kept
    with torch.no_grad():
        expected = model.sequence_logps(base, batch)
    for got, want in zip(reference, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    policy = model.sequence_logps(model.model.eval(), batch)
    assert not torch.allclose(policy[0].detach(), reference[0])  # the adapter trained away from the reference


def test_qlora_is_refused_on_cpu_and_without_pretrained_weights(base_dir):
    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    with pytest.raises(ValueError, match=r"lora.quantize='nf4' \(QLoRA\) needs a CUDA device"):
        CausalLM(pretrained_path=base_dir, lora=dict(quantize="nf4"))
    with pytest.raises(ValueError, match=r"QLoRA\) quantizes pretrained weights: give pretrained_path"):
        CausalLM(model_config=TINY, lora=dict(quantize="nf4"))


def test_bad_lora_settings_fail_at_construction():
    with pytest.raises(ValueError, match=r"lora has unknown key\(s\) \['rank'\]"):
        CausalLM(model_config=TINY, lora=dict(rank=8))
    with pytest.raises(ValueError, match=r"lora.r=0 is not valid"):
        DPO(model_config=TINY, lora=dict(r=0))
    with pytest.raises(ValueError, match=r"lora.target_modules names \['query'\]"):
        CausalLM(model_config=TINY, vocab_size=VOCAB, lora=dict(target_modules=["query"]))


def test_pretrained_model_trains_in_train_mode(base_dir):
    """from_pretrained returns a model in eval mode; Lightning keeps module modes, so dropout (the adapter's too)
    would be off in training."""
    model = CausalLM(pretrained_path=base_dir, lora=dict(r=2, dropout=0.1))
    assert all(m.training for m in model.model.modules())


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["+model/lora=default"], dict(r=16, alpha=32, dropout=0.05, target_modules="all-linear", quantize=None)),
        (["+model.lora.r=4"], dict(r=4)),
        (
            ["+model/lora=default", "model.lora.target_modules=[q_proj,v_proj]"],
            dict(target_modules=["q_proj", "v_proj"]),
        ),
        (["model=dpo", "+model/lora=qlora"], dict(quantize="nf4", r=16)),
    ],
)
def test_hydra_lora_group_and_single_fields(overrides, expected):
    from hydra import compose, initialize_config_module
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    with initialize_config_module("lightning_seqmem.conf", version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    lora = OmegaConf.to_container(cfg.model.lora)
    assert {key: lora[key] for key in expected} == expected
    if lora.get("quantize") is None:
        cfg.model.vocab_size = VOCAB
        cfg.model.model_config = TINY
        model = instantiate(cfg.model)
        assert isinstance(model.model, peft.PeftModel)
        assert model.model.peft_config["default"].r == lora["r"]


@pytest.mark.parametrize("cross_entropy", ["full", "chunked"])
def test_gradient_checkpointing_reaches_the_adapter(cross_entropy):
    model = CausalLM(
        model_config=TINY, vocab_size=VOCAB, lora=LORA, gradient_checkpointing=True, cross_entropy=cross_entropy
    )
    model.loss({"input_ids": IDS, "labels": IDS}).backward()
    adapter = [p for p in model.parameters() if p.requires_grad]
    assert adapter and all(p.grad is not None for p in adapter)
