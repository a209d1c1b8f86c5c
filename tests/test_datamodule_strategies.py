"""SeqMemDataModule strategies end to end: batch contract, token accounting, shapes, stats, errors, resume."""

import contextlib

import datasets
import pytest
import torch
from _recorder import fit_recording

from lightning_seqmem import SeqMemDataModule
from lightning_seqmem.batch import count_real_tokens
from lightning_seqmem.batching.collate import real_token_mask
from lightning_seqmem.batching.options import Pack, Pad, Truncate
from lightning_seqmem.kinds.text import text_stream_encoder


def _fed_tokens(dm, loader):
    return sum(int(real_token_mask(b, dm.pad_token_id).sum()) for b in loader)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(strategy="pad"),
        dict(batching=Pad(group_by_length=True)),
        dict(batching=Pad(to_max_length=True)),
        dict(strategy="pad", max_tokens_per_batch=160),
        dict(batching=Truncate()),
        dict(strategy="truncate", truncation_side="left"),
        dict(strategy="pack"),
        dict(batching=Pack(method="wrapped")),
        dict(batching=Pack(overflow="truncate")),
        dict(batching=Pack(overflow="drop", cu_seqlens=True)),
    ],
    ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()),
)
def test_every_strategy_keeps_the_contract_and_counts_every_token(small_text_dataset, kwargs):
    dm = SeqMemDataModule(dataset=small_text_dataset, max_length=40, micro_batch_size=4, **kwargs)
    batching = dm.settings.batching.batching
    splits_long = isinstance(batching, Pack) and batching.overflow in (None, "split")
    loses_tokens = not splits_long
    with pytest.warns(UserWarning, match="longer than max_length") if loses_tokens else contextlib.nullcontext():
        dm.setup("fit")
    rows, length = dm.max_batch_shape()
    for split, loader in (("train", dm.train_dataloader()), ("validation", dm.val_dataloader())):
        seen = 0
        for batch in loader:
            keys = set(batch)
            assert keys == set(dm.batch_keys()), (keys, dm.batch_keys())
            shape = batch["input_ids"].shape
            assert all(batch[k].shape == shape for k in keys if k != "cu_seqlens")
            assert shape[0] <= rows and shape[1] <= length
            if not isinstance(batching, Pad) or batching.to_max_length:
                assert shape[1] == 40  # constant shape
            if "max_tokens_per_batch" in kwargs:
                assert shape[0] * shape[1] <= 160
            seen += 1
        assert seen == dm.stats()[split]["batches"]
        s = dm.stats()[split]
        fed = _fed_tokens(dm, loader)
        assert fed + s["tokens_truncated"] + s["tokens_dropped"] == s["tokens"]  # nothing lost silently
        if splits_long:
            assert s["tokens_truncated"] == s["tokens_dropped"] == 0 and s["documents_split"] >= 1
        slots = sum(b["input_ids"].numel() for b in loader)
        assert s["token_efficiency"] == pytest.approx(fed / slots)


def test_packing_beats_padding_and_rows_reshuffle_without_repacking(small_text_dataset):
    pad = SeqMemDataModule(dataset=small_text_dataset, max_length=64, micro_batch_size=4, strategy="truncate")
    pack = SeqMemDataModule(dataset=small_text_dataset, max_length=64, micro_batch_size=4, strategy="pack")
    assert pack.stats()["train"]["token_efficiency"] > 0.9 > pad.stats()["train"]["token_efficiency"]
    loader = pack.train_dataloader()
    packed = pack.read_mode.rows["train"].packed
    epochs = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        epochs.append([b["input_ids"].tolist() for b in loader])
    assert epochs[0] != epochs[1] and sorted(sum(epochs[0], [])) == sorted(sum(epochs[1], []))
    assert pack.read_mode.rows["train"].packed is packed


def test_prompt_completion_truncation_and_completion_only_labels(tokenizer):
    ds = datasets.Dataset.from_dict(
        {
            "prompt": ["Question: what is two plus two?", "A very long prompt " * 30, "Say hi."],
            "completion": [" Four.", " Fine.", ""],
        }
    )
    dm = SeqMemDataModule(
        dataset=datasets.DatasetDict(train=ds, validation=ds),
        max_length=24,
        micro_batch_size=4,
        strategy="truncate",
        max_prompt_length=12,
        max_completion_length=8,
    )
    with pytest.warns(UserWarning, match="1 prompt/completion rows have no completion left"):
        dm.setup("fit")
    assert dm.stats()["train"]["rows_without_completion"] == 1  # the empty completion: reported, not trained on
    batch = next(iter(dm.val_dataloader()))
    assert batch["input_ids"].shape == (2, 24)
    for row in range(2):
        labels, mask = batch["labels"][row], batch["attention_mask"][row]
        real = int(mask.sum())
        learn = (labels != -100).nonzero().flatten()
        assert learn.numel() > 0 and learn.max() == real - 1  # the completion ends the row
        assert torch.equal(batch["input_ids"][row][learn], labels[learn])
        assert labels[0] == -100  # the prompt is not learned
    eos = tokenizer.eos_token_id
    assert batch["labels"][0][int(batch["attention_mask"][0].sum()) - 1] == eos
    full = SeqMemDataModule(dataset=ds, max_length=24, strategy="pad", completion_only_loss=False, max_prompt_length=12)
    with pytest.warns(UserWarning):
        full.setup("fit")
    b = next(iter(full.train_dataloader()))
    assert torch.equal(b["labels"][b["attention_mask"] == 1], b["input_ids"][b["attention_mask"] == 1])
    # Packed prompt/completion rows keep completion-only labels: learned tokens are exactly the completions.
    packed = SeqMemDataModule(dataset=ds, max_length=24, strategy="pack", micro_batch_size=4)
    with pytest.warns(UserWarning, match="no completion left"):
        packed.setup("fit")
    learned = sorted(t for b in packed.train_dataloader() for t in b["labels"][b["labels"] != -100].tolist())
    labels = packed.read_mode.labels["train"]  # per row: -100 on the kept prompt, then the kept completion
    rows = [labels.row(i).tolist() for i in range(len(labels))]
    expected = sorted(t for lab in rows for t in lab[1:] if t != -100)  # a segment's first never learns
    assert learned == expected and len(learned) > 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(batching=Pack(method="wrapped"), strategy="pack"), "Give batching=Pack.* or strategy='pack', not both"),
        (dict(strategy="truncate", max_length=64, max_tokens_per_batch=32), "at least 64"),
        (dict(truncation_side="middle"), "truncation_side='middle' is not valid"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SeqMemDataModule(**kwargs)


def test_part_limits_must_fit_max_length_for_prompt_completion_rows_only(tmp_path):
    """Prompt/completion rows are cut by the two per-part limits alone, so together they must fit max_length;
    preference pairs take TRL's third stage (max_length over prompt + completion) and accept any sum."""
    limits = dict(max_length=10, max_prompt_length=6, max_completion_length=6, cache_dir=tmp_path)
    sft = [{"prompt": f"question {i}", "completion": f"answer {i}"} for i in range(8)]
    with pytest.raises(ValueError, match=r"max_prompt_length \(6\) \+ max_completion_length \(6\) > max_length"):
        SeqMemDataModule(sft, **limits).setup("fit")
    pairs = [{"prompt": f"question {i}", "chosen": f"good answer {i}", "rejected": "no"} for i in range(8)]
    dm = SeqMemDataModule(pairs, **limits)
    dm.setup("fit")
    assert max(count_real_tokens(b) for b in dm.train_dataloader()) > 0


def test_bad_data(small_text_dataset):
    with pytest.raises(ValueError, match=r"document at row \d+ has \d+ tokens > max_length=40"):
        SeqMemDataModule(dataset=small_text_dataset, max_length=40, batching=Pack(overflow="error")).setup("fit")
    with pytest.raises(ValueError, match="max_tokens_per_batch=16 is smaller than one row.*>= 40"):
        SeqMemDataModule(dataset=small_text_dataset, strategy="pad", max_length=40, max_tokens_per_batch=16).setup(
            "fit"
        )
    texts = ["", "some text here", "", "more text"]
    dm = SeqMemDataModule(dataset=datasets.Dataset.from_dict({"text": texts}), strategy="pack", max_length=16)
    dm.setup("fit")
    s = dm.stats()
    assert s["train"]["empty_documents_skipped"] + s["validation"]["empty_documents_skipped"] >= 2


def test_lightning_mid_epoch_resume_replays_exactly_the_remaining_batches(small_text_dataset, tmp_path):
    full, dm = fit_recording(tmp_path, 40, dataset=small_text_dataset)
    assert len(dm.train_dataloader()) < 37  # the resumed part crosses an epoch boundary (epoch reshuffles resume too)
    partial, _ = fit_recording(tmp_path, 3, save=True, dataset=small_text_dataset)
    assert partial == full[:3]
    resumed, _ = fit_recording(tmp_path, 40, ckpt=str(tmp_path / "epoch=0-step=3.ckpt"), dataset=small_text_dataset)
    assert resumed == full[3:]


def test_streaming_dataset_is_packed_on_the_fly_without_losing_a_token(tokenizer):
    texts = [f"doc {i} " + "word " * (1 + (i * 7) % 40) for i in range(120)] + ["", "tail"]
    stream = datasets.IterableDataset.from_generator(lambda: ({"text": t} for t in texts))
    dm = SeqMemDataModule(
        dataset=stream,
        strategy="pack",
        max_length=32,
        micro_batch_size=4,
        streaming_buffer_size=16,
        streaming_validation_documents=20,
    )
    dm.setup("fit")
    assert dm.max_batch_shape() == (4, 32) and dm.stats()["train"]["streaming"]
    pieces = []
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        for batch in loader:
            assert set(batch) == set(dm.batch_keys()) and batch["input_ids"].shape[1] == 32
            real = real_token_mask(batch, dm.pad_token_id)
            for row in range(batch["input_ids"].shape[0]):
                starts = (batch["position_ids"][row] == 0).nonzero().flatten().tolist() + [32]
                pieces += [
                    batch["input_ids"][row, a:b].tolist() for a, b in zip(starts[:-1], starts[1:]) if real[row, a]
                ]
    docs = [text_stream_encoder(dm.tokenizer)(i, {"text": t}) for i, t in enumerate(texts)]
    expected = [d[j : j + 32] for d in docs for j in range(0, len(d), 32)]
    assert sorted(pieces) == sorted(expected)  # every token once, documents in order, none lost


def test_streaming_needs_pack(tokenizer):
    stream = datasets.IterableDataset.from_generator(lambda: ({"text": "a b c"} for _ in range(3)))
    with pytest.raises(
        ValueError, match=r"streaming dataset is packed on the fly: use batching=Pack\(\) .*batching=Pad\(\)"
    ):
        SeqMemDataModule(dataset=stream, strategy="pad").setup("fit")
