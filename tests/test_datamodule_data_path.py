"""The map-style data path: memory that follows documents, Arrow chunks, pre-tokenized input and its checks,
SFT-safe packing overflow, and an eval strategy that differs from training."""

import tracemalloc

import datasets
import lightning.pytorch as L
import numpy as np
import pytest
import torch

from lightning_seqmem import CausalLM, SeqMemDataModule
from lightning_seqmem.batching.collate import real_token_mask
from lightning_seqmem.batching.options import Pack, Pad, as_batching


def _fed(dm, loader):
    return sum(int(real_token_mask(b, dm.pad_token_id).sum()) for b in loader)


def _token_docs(n, seed=0, vocab=500, longest=400):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(k)).tolist() for k in rng.integers(1, longest, size=n)]


def test_setup_memory_follows_documents_not_tokens():
    """Setup reads Arrow in place: its peak allocation is far below one byte per token (a Python list per token
    would be ~60 bytes, a numpy copy 4-8)."""
    n_docs, length = 400, 2500  # 1 M tokens
    flat = np.random.default_rng(0).integers(3, 1000, size=n_docs * length).astype(np.int32)
    import pyarrow as pa

    column = pa.ListArray.from_arrays(pa.array(np.arange(0, flat.size + 1, length, dtype=np.int32)), pa.array(flat))
    ds = datasets.Dataset(pa.table({"input_ids": column}))
    for strategy in ("pack", "pad"):
        dm = SeqMemDataModule(
            dataset=ds,
            batching=Pack(overflow="split") if strategy == "pack" else as_batching(strategy),
            max_length=512,
            micro_batch_size=4,
            pad_token_id=0,
            eos_token_id=2,
        )
        tracemalloc.start()
        with pytest.warns(UserWarning) if strategy == "pad" else _nothing():
            dm.setup("fit")
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 0.5 * flat.size, (strategy, peak)
        s = dm.stats()
        assert s["train"]["tokens"] + s["validation"]["tokens"] == flat.size
        assert dm._lazy_tokenizer.loaded is None  # pre-tokenized with explicit ids: no tokenizer needed


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("strategy", ["pack", "pad", "truncate"])
def test_multi_chunk_pretokenized_dataset_keeps_every_token(strategy):
    docs = _token_docs(60, longest=60)
    parts = [datasets.Dataset.from_dict({"input_ids": docs[i : i + 7]}) for i in range(0, len(docs), 7)]
    ds = datasets.concatenate_datasets(parts)
    assert ds.data.column("input_ids").num_chunks > 1
    dm = SeqMemDataModule(
        dataset=datasets.DatasetDict(train=ds, validation=ds.select(range(5))),
        strategy=strategy,
        max_length=64,
        micro_batch_size=4,
        pad_token_id=0,
        eos_token_id=1,
    )
    dm.setup("fit")
    s = dm.stats()["train"]
    assert s["tokens"] == sum(map(len, docs))
    assert _fed(dm, dm.train_dataloader()) + s["tokens_truncated"] + s["tokens_dropped"] == s["tokens"]
    if strategy == "pack":  # tokens arrive as they were given, packed
        got = sorted(t for b in dm.train_dataloader() for t in b["input_ids"][b["labels"] != -100].tolist())
        want = sorted(t for d in docs for t in d[1:])  # a document's first token is never a target
        assert got == want


def test_pretokenized_labels_and_prompt_completion_ids_are_used_as_given():
    ids = [[10, 11, 12, 13], [20, 21, 22]]
    labels = [[-100, -100, 12, 13], [-100, 21, 22]]
    dm = SeqMemDataModule(
        dataset=datasets.DatasetDict(
            train=datasets.Dataset.from_dict({"input_ids": ids, "labels": labels}),
            validation=datasets.Dataset.from_dict({"input_ids": ids[:1], "labels": labels[:1]}),
        ),
        batching=Pad(to_multiple_of=None),
        max_length=8,
        micro_batch_size=2,
        pad_token_id=0,
        seed=1,
    )
    batch = next(iter(dm.train_dataloader()))
    rows = {
        tuple(r[m.bool()].tolist()): lab[m.bool()].tolist()
        for r, m, lab in zip(batch["input_ids"], batch["attention_mask"], batch["labels"])
    }
    assert rows == {tuple(i): lab for i, lab in zip(ids, labels)} and dm._lazy_tokenizer.loaded is None
    pc = datasets.Dataset.from_dict({"prompt_ids": [[30, 31, 32], [40]], "completion_ids": [[33, 34], [41, 42]]})
    dm = SeqMemDataModule(
        dataset=datasets.DatasetDict(train=pc, validation=pc),
        strategy="pack",
        max_length=8,
        micro_batch_size=2,
        pad_token_id=0,
    )
    learned = sorted(t for b in dm.train_dataloader() for t in b["labels"][b["labels"] != -100].tolist())
    assert learned == [33, 34, 41, 42]  # completion-only loss on the ids as given


@pytest.mark.parametrize(
    "column, values, match",
    [
        (
            "input_ids",
            [[1, 2], [3, -4, 5], [6]],
            r"Row 1 of split 'train', column 'input_ids' holds a token id outside",
        ),
        ("input_ids", [[1, 2], [3], [6, 70000]], r"Row 2 of split 'train', column 'input_ids' .*\[0, \d+\)"),
        ("input_ids", [[1.0, 2.5], [3.0], [6.0]], r"column 'input_ids' holds double values: token ids must be"),
        ("labels", [[1, 2], [-100, -7], [6]], r"Row 1 of split 'train', column 'labels'"),
    ],
)
def test_bad_token_values_name_the_row(tokenizer, column, values, match):
    data = {"input_ids": [[1, 2], [3, 4], [6]], column: values}
    dm = SeqMemDataModule(dataset=datasets.Dataset.from_dict(data), tokenizer=tokenizer, max_length=8)
    with pytest.raises(ValueError, match=match):
        dm.setup("fit")


def test_integral_numpy_arguments_are_accepted(small_text_dataset):
    dm = SeqMemDataModule(
        dataset=small_text_dataset,
        max_length=np.int64(64),
        micro_batch_size=np.int32(4),
        eval_batch_size=np.int64(2),
        strategy="pack",
        num_proc=np.int64(1),
    )
    assert dm.max_length == 64 and type(dm.max_length) is int and dm.max_batch_shape() == (4, 64)
    with pytest.raises(ValueError, match="micro_batch_size must be an int >= 1"):
        SeqMemDataModule(micro_batch_size=2.0)


def _sft():
    prompts = ["Question: " + "why " * (3 + i % 9) + "?" for i in range(24)]
    completions = [" Because " + "so " * (2 + (i * 5) % 12) for i in range(24)]
    prompts[0] = "Tell me " * 80  # longer than max_length on its own
    ds = datasets.Dataset.from_dict({"prompt": prompts, "completion": completions})
    return datasets.DatasetDict(train=ds, validation=ds.select(range(6)))


def test_packed_sft_rows_are_truncated_not_split_by_default(tokenizer):
    dm = SeqMemDataModule(dataset=_sft(), strategy="pack", max_length=32, micro_batch_size=4, truncation_side="left")
    with pytest.warns(UserWarning, match="never reach the model"):
        dm.setup("fit")
    s = dm.stats()["train"]
    assert s["documents_split"] == 0 and s["tokens_truncated"] > 0 and s["rows_without_completion"] == 0
    assert _fed(dm, dm.train_dataloader()) + s["tokens_truncated"] + s["tokens_dropped"] == s["tokens"]
    for batch in dm.train_dataloader():  # every document (segment) starts with its prompt: never a bare answer
        for row in range(batch["input_ids"].shape[0]):
            starts = (batch["position_ids"][row] == 0).nonzero().flatten()
            real = real_token_mask(batch, dm.pad_token_id)[row]
            for a in starts.tolist():
                if real[a] and a + 1 < batch["labels"].shape[1] and batch["position_ids"][row, a + 1] == 1:
                    assert batch["labels"][row, a + 1] == -100  # the token after a segment start is a prompt token


def test_splitting_sft_rows_needs_an_explicit_opt_in(tokenizer):
    with pytest.raises(ValueError, match="allow_split_prompt_completion=True"):
        SeqMemDataModule(dataset=_sft(), batching=Pack(overflow="split"), max_length=32).setup("fit")
    dm = SeqMemDataModule(
        dataset=_sft(), batching=Pack(overflow="split", allow_split_prompt_completion=True), max_length=32
    )
    dm.setup("fit")
    assert dm.stats()["train"]["documents_split"] >= 1 and dm.stats()["train"]["tokens_truncated"] == 0


def test_padded_and_packed_validation_give_the_same_per_token_loss(tmp_path, tokenizer):
    """Packing changes nothing but speed: the same model on the same documents, validated packed (training's
    strategy) and padded (eval_strategy), gives the same per-token loss."""
    texts = [f"Document {i}: " + "alpha beta gamma delta " * (1 + i % 6) for i in range(30)]
    ds = datasets.Dataset.from_dict({"text": texts})
    dsd = datasets.DatasetDict(train=ds, validation=ds)
    torch.manual_seed(0)
    model = CausalLM(
        model_config=dict(
            model_type="llama",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
        ),
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
    )
    model.eval()
    losses = {}
    for eval_strategy in ("pack", "pad"):
        dm = SeqMemDataModule(
            dataset=dsd,
            tokenizer=tokenizer,
            strategy="pack",
            eval_strategy=eval_strategy,
            max_length=128,
            micro_batch_size=3,
            eval_batch_size=3,
        )
        dm.setup("fit")
        assert dm.batch_keys() == ("input_ids", "labels", "position_ids")  # the train loader's keys
        val_keys = set(next(iter(dm.val_dataloader())))
        assert ("attention_mask" in val_keys) == (eval_strategy == "pad")
        assert dm.stats()["validation"]["tokens_truncated"] == 0  # the same documents, whole, both ways
        trainer = L.Trainer(
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        losses[eval_strategy] = trainer.validate(model, datamodule=dm, verbose=False)[0]["val/loss"]
    assert losses["pack"] == pytest.approx(losses["pad"], abs=1e-5)


def test_pretokenized_values_are_checked_once_per_dataset_version(tmp_path, tokenizer, monkeypatch):
    """A file-backed pre-tokenized dataset is checked in the first run only (streamed from the files, not
    memory-mapped); a bad one never gets a pass and the exact check names its row."""
    import lightning_seqmem.data.columns as data_source
    import lightning_seqmem.data.value_checks as token_cache

    calls = []
    streamed, exact = token_cache._streamed_largest, data_source.check_token_values
    monkeypatch.setattr(token_cache, "_streamed_largest", lambda *a: calls.append("streamed") or streamed(*a))
    monkeypatch.setattr(data_source, "check_token_values", lambda *a, **k: calls.append("exact") or exact(*a, **k))
    datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]] * 4}).save_to_disk(tmp_path / "good")
    for _run in range(2):
        dm = SeqMemDataModule(
            dataset=str(tmp_path / "good"), tokenizer=tokenizer, max_length=8, cache_dir=tmp_path / "cache"
        )
        dm.setup("fit")
        assert dm.stats()["train"]["tokens"] + dm.stats()["validation"]["tokens"] == 36
    assert calls == ["streamed"]  # clean in the stream: no exact pass; the second run trusted the first

    datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, -4]] * 4}).save_to_disk(tmp_path / "bad")
    for _run in range(2):  # a failed check leaves nothing behind: the error comes every time
        with pytest.raises(ValueError, match="Row 1 of split 'train', column 'input_ids' holds a token id outside"):
            SeqMemDataModule(
                dataset=str(tmp_path / "bad"), tokenizer=tokenizer, max_length=8, cache_dir=tmp_path / "cache"
            ).setup("fit")
    assert calls[1:] == ["streamed", "exact"] * 2


def test_pretokenized_ids_with_their_own_special_ids_never_size_a_model_from_the_builtin_tokenizer(tmp_path):
    """Ids beyond the built-in vocabulary: the DataModule offers no tokenizer, so CausalLM asks for vocab_size
    (instead of building a 4,096-token model that would index past its embeddings); with it, training runs."""
    import lightning.pytorch as L

    from lightning_seqmem import CausalLM

    rows = [[9000 + (i * 7 + j) % 900 for j in range(5 + i % 9)] for i in range(40)]
    data = datasets.Dataset.from_dict({"input_ids": rows})

    def fit(model):
        dm = SeqMemDataModule(
            dataset=data,
            pad_token_id=0,
            eos_token_id=1,
            strategy="pack",
            max_length=16,
            micro_batch_size=4,
            cache_dir=tmp_path,
        )
        trainer = L.Trainer(
            max_steps=2,
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            limit_val_batches=1,
            default_root_dir=tmp_path,
        )
        trainer.fit(model, datamodule=dm)
        return dm, trainer

    with pytest.raises(ValueError, match="CausalLM needs a vocabulary size: pass vocab_size"):
        fit(CausalLM())
    model = CausalLM(vocab_size=10_000)
    dm, trainer = fit(model)
    assert dm.tokenizer is None and dm.eos_token_id == 1
    assert model.hparams.pad_token_id == 0 and trainer.global_step == 2
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
