"""Typed questions between components (lightning_seqmem.protocols), answered by the real DataModule and callbacks."""

import lightning.pytorch as L
import pytest

from lightning_seqmem import CachePreallocator, CausalLM, SeqLengthWarmup, SeqMemDataModule
from lightning_seqmem.apps.job_record import JobRecord
from lightning_seqmem.memory.checks import gather_facts
from lightning_seqmem.protocols import (
    GivesBatchKeys,
    GivesDataStats,
    GivesMaxBatchShape,
    GivesWarmupShape,
    find_pad_token_id,
)

TINY = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


@pytest.mark.parametrize("strategy", ["pad", "pack"])
def test_datamodule_answers_its_questions(small_text_dataset, strategy):
    dm = SeqMemDataModule(dataset=small_text_dataset, strategy=strategy, max_length=64, micro_batch_size=4)
    assert isinstance(dm, GivesMaxBatchShape) and isinstance(dm, GivesBatchKeys) and isinstance(dm, GivesDataStats)
    assert not isinstance(dm, GivesWarmupShape)  # a different question, under a different name
    rows, length = dm.max_batch_shape()
    assert rows == 4 and length == 64
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == set(dm.batch_keys())


def test_warmup_answers_the_warmup_question_only():
    warmup = SeqLengthWarmup(min_seq_length=8, max_seq_length=64, truncate=False)
    assert isinstance(warmup, GivesWarmupShape)
    assert not isinstance(warmup, GivesBatchKeys) and not isinstance(CachePreallocator(), GivesWarmupShape)
    assert warmup.max_warmup_shape(4, 64) == (4, 64)


def test_config_checks_see_warmup_and_preallocator_by_type(tmp_path):
    model = CausalLM(model_config=TINY, vocab_size=64, pad_token_id=0)
    plain = L.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path)
    facts = gather_facts(plain, model)
    assert not facts.dynamic_shapes and not facts.preallocating
    callbacks = [SeqLengthWarmup(max_seq_length=64), CachePreallocator()]
    facts = gather_facts(
        L.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path, callbacks=callbacks), model
    )
    assert facts.dynamic_shapes and facts.preallocating


def test_find_pad_token_id_reads_attributes_and_mappings():
    class Owner:
        pad_token_id = 3

    assert find_pad_token_id(None, {"pad_token_id": 7}, Owner()) == 7
    assert find_pad_token_id(object(), {"pad_token_id": None}, Owner()) == 3
    assert find_pad_token_id({"pad_token_id": True}) is None  # a bool is not a token id
    assert find_pad_token_id() is None


def test_every_consumer_counts_the_same_real_tokens(small_text_dataset, tmp_path):
    """Model, warmup callback and job record agree on a packed run with reshape warmup (one counter)."""
    L.seed_everything(0)
    dm = SeqMemDataModule(dataset=small_text_dataset, strategy="pack", max_length=64, micro_batch_size=2)
    warmup = SeqLengthWarmup(duration=0.5, min_seq_length=16, max_seq_length=64, step_size=16, truncate=False)
    record = JobRecord()
    model = CausalLM(model_config=TINY)
    trainer = L.Trainer(
        max_steps=4,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        val_check_interval=4,
        default_root_dir=tmp_path,
        callbacks=[warmup, record],
    )
    trainer.fit(model, datamodule=dm)
    rows = (tmp_path / "progress.csv").read_text().splitlines()
    tokens_in_record = int(rows[-1].split(",")[4])
    assert 0 < model.real_tokens_seen == warmup.tokens_seen == tokens_in_record
