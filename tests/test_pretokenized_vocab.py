"""Pre-tokenized data without a tokenizer, trained with a model whose embedding table is smaller than the data's
largest id: refused before the first step, naming the id, where it is, the model's rows and the fix (before, a bare
``IndexError: index out of range in self`` at the first forward; a device-side assert on CUDA). The largest id is
found by the value check the data get once per dataset version and remembered with it: a dataset re-opened from
disk is not read again."""

import warnings

import datasets
import pytest

from lightning_seqmem import DPO, CausalLM, SeqMemDataModule
from lightning_seqmem.data import columns, value_checks
from lightning_seqmem.data.columns import LargestTokenId
from lightning_seqmem.protocols import GivesLargestTokenId

TINY = dict(
    model_type="llama",
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)


def quiet_trainer():
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=1,
        limit_val_batches=0,
    )


def id_splits(largest=99):
    """Train ids below 60; the validation split holds ``largest`` (in ``labels``, a copy of the ids)."""
    train = [[1 + (i * 7 + j) % 59 for j in range(4 + i % 5)] for i in range(16)]
    validation = [[3, 4, 5], [6, largest, 7], [8, 9]]
    return datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"input_ids": train, "labels": train}),
        validation=datasets.Dataset.from_dict({"input_ids": validation, "labels": validation}),
    )


def id_module(data, tmp_path):
    return SeqMemDataModule(data, max_length=16, micro_batch_size=4, pad_token_id=0, cache_dir=tmp_path / "cache")


REFUSAL = (
    r"largest token id is 99 \(split 'validation', column 'input_ids'\) but the model's vocabulary has 64 tokens "
    r"\(embedding rows\).*IndexError.*vocab_size=100.*resize_token_embeddings\(100\)"
)


def fit(model, dm):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quiet_trainer().fit(model, datamodule=dm)


def test_in_memory_ids_above_the_embedding_table_are_refused_and_a_large_enough_model_trains(tmp_path):
    dm = id_module(id_splits(), tmp_path)
    with pytest.raises(ValueError, match=REFUSAL):
        fit(CausalLM(model_config=TINY, vocab_size=64), dm)
    assert isinstance(dm, GivesLargestTokenId) and dm.tokenizer is None  # no tokenizer to bound the ids
    assert dm.largest_token_id() == LargestTokenId(99, "validation", "input_ids")
    model = CausalLM(model_config=TINY, vocab_size=100)
    fit(model, dm)
    assert model.trainer.global_step == 1


def test_ids_saved_to_disk_are_read_once_and_refused_on_every_run(tmp_path, monkeypatch):
    id_splits().save_to_disk(tmp_path / "ids")
    reads = []  # the two ways the check reads tokens: streamed from the files, or the exact check
    streamed, exact = value_checks._streamed_largest, columns.check_token_values
    monkeypatch.setattr(value_checks, "_streamed_largest", lambda *a: reads.append("streamed") or streamed(*a))
    monkeypatch.setattr(columns, "check_token_values", lambda *a, **k: reads.append("exact") or exact(*a, **k))
    for run in range(2):  # a fresh DataModule on the re-opened dataset each run, as a new process would have
        dm = id_module(datasets.load_from_disk(str(tmp_path / "ids")), tmp_path)
        with pytest.raises(ValueError, match=REFUSAL):
            fit(CausalLM(model_config=TINY, vocab_size=64), dm)
        assert reads == ["streamed"] * 2, f"run {run}"  # once per split, on the first run only


def test_dpo_on_preference_ids_above_the_embedding_table_is_refused(tmp_path):
    pairs = {
        "prompt_ids": [[1 + i % 9, 2] for i in range(12)],
        "chosen_ids": [[3, 4 + i % 5] for i in range(12)],
        "rejected_ids": [[5, 70 if i == 7 else 6] for i in range(12)],
    }
    dm = id_module(datasets.Dataset.from_dict(pairs), tmp_path)
    with pytest.raises(ValueError, match=r"largest token id is 70 \(split 'train', column 'rejected_ids'\).*64 tokens"):
        fit(DPO(model_config=TINY, vocab_size=64), dm)


def test_the_largest_id_counts_only_the_rows_a_dataset_selects(tmp_path):
    ds = id_splits()["validation"]
    ds.save_to_disk(tmp_path / "v")
    on_disk = datasets.load_from_disk(str(tmp_path / "v"))
    for data in (ds, on_disk):  # in memory; on disk (read as a stream of record batches)
        for view, largest in ((data.select([0, 2]), 9), (data.select(range(1)), 5), (data.shuffle(seed=0), 99)):
            found = value_checks.check_values_once(
                view, "ids", ("input_ids", "labels"), "v", cache_dir=tmp_path / "cache"
            )
            assert found.id == largest
    stream = SeqMemDataModule(ds.to_iterable_dataset(), strategy="pack", max_length=16, pad_token_id=0)
    assert stream.largest_token_id() is None  # streams: checked against a given tokenizer, as they are read
