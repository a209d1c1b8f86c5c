import logging

import lightning.pytorch as L
import pytest
import torch

from lightning_seqmem import CausalLM, SeqMemDataModule
from lightning_seqmem.training.building import build_model_config
from lightning_seqmem.training.optimization import lr_factor


def _batch(vocab=64, rows=4, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 16:] = 0  # one padded row
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny_llama", "tiny_gpt2"])
def test_overfits_one_batch(preset):
    torch.manual_seed(0)
    model = CausalLM(model_config=preset, vocab_size=64, pad_token_id=0, learning_rate=3e-3)
    batch = _batch()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(40):
        loss = model(batch).loss
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first / 2


def test_vocab_size_comes_from_the_datamodule_tokenizer(small_text_dataset, tmp_path):
    dm = SeqMemDataModule(dataset=small_text_dataset, max_length=64, micro_batch_size=4)
    model = CausalLM()
    assert model.model is None  # built at setup, once the tokenizer is known
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=1,
        val_check_interval=3,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm)
    assert model.model.config.vocab_size == len(dm.tokenizer)
    assert model.hparams.vocab_size == len(dm.tokenizer)
    metrics = trainer.callback_metrics
    for key in (
        "train/loss",
        "train/ppl",
        "val/loss",
        "val/ppl",
        "train/real_token_fraction",
        "train/real_tokens_seen",
        "train/token_efficiency",
    ):
        assert key in metrics, key
    assert torch.isclose(metrics["val/ppl"], torch.exp(metrics["val/loss"]))
    # Real tokens counted from the attention mask, never more than the slots.
    assert 0 < model.real_tokens_seen <= model.slots_seen


def test_checkpoint_round_trip(small_text_dataset, tmp_path):
    dm = SeqMemDataModule(dataset=small_text_dataset, max_length=64, micro_batch_size=4)
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    model = CausalLM(model_config="tiny_gpt2")
    trainer.fit(model, datamodule=dm)
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    restored = CausalLM.load_from_checkpoint(path)  # vocab size was saved in hparams at setup
    for (name, a), (_, b) in zip(model.state_dict().items(), restored.state_dict().items()):
        assert torch.equal(a, b), name


def test_local_pretrained_path(tmp_path):
    model = CausalLM(vocab_size=64)
    model.model.save_pretrained(tmp_path / "hf")
    loaded = CausalLM(pretrained_path=str(tmp_path / "hf"))
    batch = _batch()
    torch.testing.assert_close(loaded(batch).loss, model(batch).loss)


def test_bad_model_config():
    with pytest.raises(ValueError, match="Unknown model_config 'tiny_bert'.*tiny_gpt2"):
        build_model_config("tiny_bert", 64, 0)
    with pytest.raises(ValueError, match="model_type"):
        build_model_config({"hidden_size": 8}, 64, 0)
    with pytest.raises(ValueError, match="learning_rate"):
        CausalLM(learning_rate=0)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    values = [lr_factor(s, 10, 100, 0.1) for s in range(101)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(values[10:], values[11:]))
    assert values[100] == pytest.approx(0.1)


def test_rows_longer_than_learned_positions_fail_before_the_first_step(small_text_dataset, tmp_path):
    dm = SeqMemDataModule(dataset=small_text_dataset, max_length=64, micro_batch_size=4, strategy="pack")
    model = CausalLM(model_config=dict(model_type="gpt2", n_embd=32, n_layer=1, n_head=2, n_positions=32))
    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    with pytest.raises(
        ValueError,
        match=r"up to 64 tokens .* 32 positions \(GPT2Config.n_positions=32\).*"
        r"max_length to 32 or less.*n_positions >= 64",
    ):
        trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 0


def test_rows_longer_than_rope_positions_warn(small_text_dataset, tmp_path):
    dm = SeqMemDataModule(dataset=small_text_dataset, max_length=64, micro_batch_size=4, strategy="pack")
    config = dict(
        model_type="llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=32,
    )
    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    with pytest.warns(UserWarning, match=r"max_position_embeddings=32.*max_length to 32 or less"):
        trainer.fit(CausalLM(model_config=config), datamodule=dm)  # RoPE runs past the limit: a warning only
    assert trainer.global_step == 1


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_a_gpt2_config_of_our_vocabulary_builds_and_trains_without_transformers_warnings():
    """GPT-2's config defaults (bos/eos 50256) do not fit a 4,096-token vocabulary, and its class name maps to no
    loss: both made right, so transformers says nothing at build or at the first loss; what the caller gives stays."""
    logging.Logger.warning_once.cache_clear()  # transformers warns once per process: make this test see it
    records, hf_logger = _Records(), logging.getLogger("transformers")
    hf_logger.addHandler(records)  # transformers' own handler writes to the stream it found at import
    try:
        lm = CausalLM(model_config=dict(model_type="gpt2", n_embd=32, n_layer=1, n_head=2), vocab_size=4096)
        ids = torch.randint(0, 4096, (2, 16))
        lm.model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False).loss.backward()
    finally:
        hf_logger.removeHandler(records)
    assert records.messages == []
    assert lm.model.config.bos_token_id is None and lm.model.loss_type == "ForCausalLM"
    kept = build_model_config(dict(model_type="gpt2", bos_token_id=7), vocab_size=4096, pad_token_id=0)
    assert kept.bos_token_id == 7 and kept.eos_token_id is None
    assert build_model_config("tiny_llama", 4096, 0).bos_token_id == 1  # in range: Llama's default stays
