"""The padded loader of the foundation: shapes, masks, exact truncation counts and the bad-input errors."""

import json

import datasets
import pytest
import torch

from lightning_seqmem import SeqMemDataModule


def _lengths(dm, split="train"):
    return [len(x) for x in dm.datasets[split]["input_ids"]]


def test_padded_batches_have_the_promised_shapes_and_masks(small_text_dataset):
    dm = SeqMemDataModule(dataset=small_text_dataset, strategy="pad", max_length=50, micro_batch_size=4)
    dm.setup("fit")
    pad = dm.pad_token_id
    for batch in dm.train_dataloader():
        ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        assert ids.shape == mask.shape == labels.shape and ids.dtype == torch.long
        assert ids.shape[1] % 8 == 0 or ids.shape[1] == 50  # multiple of 8, capped at max_length
        assert ids.shape[1] <= 50
        longest = int(mask.sum(1).max())
        assert ids.shape[1] < longest + 8  # padded to the longest row, not beyond the next multiple
        assert torch.all(ids[mask == 0] == pad)
        assert torch.all(labels[mask == 0] == -100)
        assert torch.equal(labels[mask == 1], ids[mask == 1])
        assert torch.all(mask.cummin(1).values == mask)  # right padding: ones then zeros


def test_truncation_count_is_exact(small_text_dataset, tokenizer):
    dm = SeqMemDataModule(dataset=small_text_dataset, strategy="pad", max_length=40, micro_batch_size=4)
    with pytest.warns(
        UserWarning, match=r"longer than max_length=40; with batching=Pad\(\).*batching=Pack\(overflow='split'\)"
    ):
        dm.setup("fit")
    expected = 0
    for split in ("train", "validation"):
        lengths = _lengths(dm, split)
        assert dm.stats()[split]["tokens_truncated"] == sum(max(0, n - 40) for n in lengths)
        assert dm.stats()[split]["tokens"] == sum(lengths)
        expected += sum(max(0, n - 40) for n in lengths)
    fed = sum(int(b["attention_mask"].sum()) for b in dm.train_dataloader())
    fed += sum(int(b["attention_mask"].sum()) for b in dm.val_dataloader())
    total = dm.stats()["train"]["tokens"] + dm.stats()["validation"]["tokens"]
    assert expected > 0 and fed + expected == total  # nothing lost silently


def test_documents_get_bos_and_eos(small_text_dataset, tokenizer):
    dm = SeqMemDataModule(dataset=small_text_dataset, max_length=2048)
    dm.setup("fit")
    row = dm.datasets["train"][0]["input_ids"]
    assert row[0] == tokenizer.bos_token_id and row[-1] == tokenizer.eos_token_id


def test_local_files(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"line {i} " * (i + 1)}) for i in range(30)))
    dm = SeqMemDataModule(dataset=str(path), max_length=32, micro_batch_size=2)
    dm.setup("fit")
    assert dm.stats()["train"]["documents"] + dm.stats()["validation"]["documents"] == 30
    assert next(iter(dm.train_dataloader()))["input_ids"].shape[0] == 2
    txt = tmp_path / "a.txt"
    txt.write_text("first line\nsecond line\nthird line\n")
    dm = SeqMemDataModule(dataset=str(txt), max_length=32)
    dm.setup("fit")
    assert dm.stats()["train"]["documents"] + dm.stats()["validation"]["documents"] == 3


def test_builtin_default_and_max_batch_shape():
    dm = SeqMemDataModule(strategy="pad", max_length=128, micro_batch_size=4, eval_batch_size=6)
    assert dm.max_batch_shape() == (6, 128)  # the corpus has documents longer than 128
    assert dm.batch_keys() == ("input_ids", "attention_mask", "labels")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(max_length=1), ValueError, "max_length must be an int >= 2"),
        (dict(micro_batch_size=0), ValueError, "micro_batch_size must be an int >= 1"),
        (dict(strategy="bucket"), ValueError, "Unknown strategy 'bucket'; choose one of"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        SeqMemDataModule(**kwargs)


def test_bad_datasets(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SeqMemDataModule(dataset=str(tmp_path / "missing.jsonl")).setup("fit")
    with pytest.raises(ValueError, match="no usable column.*'body'.*text_column"):
        SeqMemDataModule(dataset=datasets.Dataset.from_dict({"body": ["a", "b"]})).setup("fit")
    with pytest.raises(ValueError, match="train split is empty"):
        SeqMemDataModule(dataset=datasets.Dataset.from_dict({"text": []})).setup("fit")
    with pytest.raises(TypeError, match="Row 1 of split 'train', column 'text' is NoneType"):
        SeqMemDataModule(dataset=datasets.Dataset.from_dict({"text": ["ok", None, "fine"]})).setup("fit")


def test_a_micro_batch_larger_than_the_training_split_is_reported_once(tmp_path):
    """512 rows asked, 5 documents given: one batch of 5 rows an epoch, said once with both figures."""
    import warnings

    docs = [f"document {i}: " + "words " * (4 + i) for i in range(6)]
    dm = SeqMemDataModule(docs, strategy="pad", micro_batch_size=512, max_length=64, cache_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.setup("fit")
    said = [str(w.message) for w in caught if "micro_batch_size=512" in str(w.message)]
    rows = dm.stats()["train"]["rows"]
    assert len(said) == 1 and f"larger than the {rows} row(s) the split holds (with batching=Pad())" in said[0]
    assert next(iter(dm.train_dataloader()))["input_ids"].shape[0] == rows  # what it says: one batch of them
    quiet = SeqMemDataModule(docs, strategy="pad", micro_batch_size=rows, max_length=64, cache_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.setup("fit")
    assert not [w for w in caught if "micro_batch_size" in str(w.message)]
