"""Streams (``datasets.IterableDataset``) at the scale they are used: sharded files, loader workers, DDP ranks.

Every document is read once (not once per worker or rank, and none skipped), every token ``max_length`` takes is
counted as it is read (the same counts as the map-style pipeline gives for the same data), and a shuffled stream
is dealt anew each epoch."""

import json
import os
import warnings
from collections import Counter

import _stream_dist_script as stream_dist
import datasets
import pytest
import torch.distributed as dist
from _forked_ranks import run_ranks

from lightning_seqmem import SeqMemDataModule
from lightning_seqmem.batching import StreamingPacker
from lightning_seqmem.batching.collate import real_token_mask
from lightning_seqmem.batching.options import Pack
from lightning_seqmem.data.chat_corpus import load_builtin_chat_corpus

COUNTED = (
    "documents",
    "empty_documents_skipped",
    "tokens",
    "tokens_truncated",
    "tokens_dropped",
    "documents_split",
    "documents_over_max_length",
    "longest_document",
)


def _write_shards(directory, shards=4, per_shard=30):
    """``shards`` jsonl files; every document names its shard and index, and some are longer than 24 tokens."""
    paths = []
    for s in range(shards):
        path = os.path.join(directory, f"part{s}.jsonl")
        with open(path, "w") as f:
            for i in range(per_shard):
                text = "" if i == 7 and s else f"shard {s} doc {i} " + "word " * (1 + (i * 5 + s) % 29)
                f.write(json.dumps({"text": text}) + "\n")
        paths.append(path)
    return paths


def _documents(batch, pad_token_id):
    """The real documents (pieces) of a packed batch, as token tuples."""
    out, real = [], real_token_mask(batch, pad_token_id)
    for row in range(batch["input_ids"].shape[0]):
        ids, pos = batch["input_ids"][row], batch["position_ids"][row]
        starts = (pos == 0).nonzero().flatten().tolist() + [len(ids)]
        out += [tuple(ids[a:b].tolist()) for a, b in zip(starts[:-1], starts[1:]) if real[row, a]]
    return out


def _stream(paths):
    return datasets.load_dataset("json", data_files=paths, split="train", streaming=True)


@pytest.mark.parametrize("overflow", ["split", "truncate", "drop"])
def test_streaming_packer_counts_what_overflow_does(overflow):
    docs = [list(range(n)) for n in (3, 30, 10, 25, 8)]
    counts = Counter()
    rows = list(StreamingPacker(10, buffer_size=2, overflow=overflow)(iter(docs), counts))
    fed = sum(len(r["input_ids"]) for r in rows)
    assert fed + counts["tokens_truncated"] + counts["tokens_dropped"] == sum(map(len, docs))
    assert counts["documents_over_max_length"] == 2 and counts["rows"] == len(rows)
    assert counts["documents_split"] == (2 if overflow == "split" else 0)
    assert counts["tokens_dropped"] == (55 if overflow == "drop" else 0)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sharded_stream_reads_every_document_once_with_workers(tmp_path, tokenizer, num_workers):
    """4 files, 2 workers: each worker reads its own files (``datasets`` deals them out) and nothing else, so the
    train and validation documents together are the stream's documents, each once."""
    paths = _write_shards(tmp_path)
    dm = SeqMemDataModule(
        dataset=_stream(paths),
        max_length=24,
        micro_batch_size=4,
        strategy="pack",
        num_workers=num_workers,
        streaming_validation_documents=12,
        streaming_buffer_size=8,
    )
    dm.setup("fit")
    seen, expected, documents = _read_once(dm, paths)
    assert seen == expected
    stats = dm.stats()
    assert stats["train"]["documents"] + stats["validation"]["documents"] == documents
    assert stats["train"]["empty_documents_skipped"] + stats["validation"]["empty_documents_skipped"] == 3


def test_validation_documents_are_the_streams_first_and_never_trained_on(tokenizer):
    """The first ``streaming_validation_documents`` of the stream validate; training leaves them out, copies
    of them further on included, whatever the number of readers."""
    texts = [f"doc {i} " + "word " * (1 + i % 5) for i in range(40)] + ["doc 1 word word "]  # a copy of doc 1
    stream = datasets.Dataset.from_dict({"text": texts}).to_iterable_dataset(num_shards=4)
    dm = SeqMemDataModule(
        dataset=stream,
        max_length=32,
        micro_batch_size=4,
        strategy="pack",
        num_workers=2,
        streaming_validation_documents=3,
    )
    dm.setup("fit")
    assert dm.datasets["validation"] == [{"text": t} for t in texts[:3]]
    trained = {d for b in dm.train_dataloader() for d in _documents(b, dm.pad_token_id)}
    validated = {d for b in dm.val_dataloader() for d in _documents(b, dm.pad_token_id)}
    assert len(validated) == 3 and not trained & validated
    assert dm.stats()["train"]["documents"] == 37  # 40 + the copy - the 3 validation documents - the copy
    assert dm.stats()["train"]["documents_left_out_as_validation"] == 4  # the 3 and the copy, counted in workers


def test_training_copies_of_validation_documents_are_counted_and_warned_each_pass(tokenizer):
    """A training document equal to a validation document is left out: ``stats()`` counts it, and each pass says
    how many and why (the validation head is carved out of the stream by content)."""
    texts = ["alpha beta", "gamma delta", "epsilon zeta", "alpha beta", "eta theta", "alpha beta"]
    stream = datasets.Dataset.from_dict({"text": texts}).to_iterable_dataset()
    dm = SeqMemDataModule(dataset=stream, max_length=16, strategy="pack", streaming_validation_documents=1)
    dm.setup("fit")
    for passes in (1, 2):
        with pytest.warns(
            UserWarning, match=r"train stream: 3 document\(s\) .* the 1 validation document\(s\) and at least 2 copies"
        ):
            list(dm.train_dataloader())
        stats = dm.stats()["train"]
        assert (stats["documents"], stats["documents_left_out_as_validation"]) == (3 * passes, 3 * passes)
    assert "documents_left_out_as_validation" not in dm.stats()["validation"]


def _read_once(dm, paths):
    """``(pieces the train and validation loaders gave, the files' documents cut at 24, documents)``, sorted."""
    seen = [
        d
        for loader in (dm.train_dataloader(), dm.val_dataloader())
        for batch in loader
        for d in _documents(batch, dm.pad_token_id)
    ]
    encoded = _encoded(SeqMemDataModule(max_length=24, strategy="pack"), paths)
    return sorted(seen), sorted(tuple(d[j : j + 24]) for d in encoded for j in range(0, len(d), 24)), len(encoded)


def _texts(paths):
    return [json.loads(line)["text"] for p in paths for line in open(p)]


def _encoded(dm, paths):
    from lightning_seqmem.kinds.text import text_stream_encoder

    encode = text_stream_encoder(dm.tokenizer)
    return [d for i, t in enumerate(_texts(paths)) if (d := encode(i, {"text": t}))]


@pytest.mark.parametrize("overflow", ["split", "truncate", "drop"])
def test_stream_counts_every_lost_token_as_the_map_style_pipeline_does(tmp_path, tokenizer, overflow):
    """The same train/validation data as a stream and as a ``DatasetDict``: after one pass the stream's counts are
    the map-style ``stats()``, and the tokens fed plus those counted lost are the tokens read."""
    paths = _write_shards(tmp_path, shards=2)
    rows = [{"text": t} for t in _texts(paths)]
    kwargs = dict(max_length=24, micro_batch_size=4, batching=Pack(overflow=overflow), streaming_buffer_size=8)
    whole = SeqMemDataModule(
        dataset=datasets.DatasetDict(
            {"train": datasets.Dataset.from_list(rows[:40]), "validation": datasets.Dataset.from_list(rows[40:])}
        ),
        cache_dir=tmp_path / "cache",
        **kwargs,
    )
    stream = datasets.IterableDatasetDict(
        {
            "train": datasets.Dataset.from_list(rows[:40]).to_iterable_dataset(),
            "validation": datasets.Dataset.from_list(rows[40:]).to_iterable_dataset(),
        }
    )
    dm = SeqMemDataModule(dataset=stream, **kwargs)
    dm.setup("fit")
    loses = overflow != "split"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fed = sum(int(real_token_mask(batch, dm.pad_token_id).sum()) for batch in dm.train_dataloader())
    warned = [w for w in caught if "train stream: documents longer than max_length=24 lose tokens" in str(w.message)]
    assert len(warned) == loses  # once per pass, and only when tokens are lost
    got, want = dm.stats()["train"], whole.stats()["train"]
    assert {k: got[k] for k in COUNTED} == {k: want[k] for k in COUNTED}
    assert fed + got["tokens_truncated"] + got["tokens_dropped"] == got["tokens"]
    assert (got["tokens_truncated"] + got["tokens_dropped"] > 0) == loses


def test_streamed_conversations_count_cut_turns_as_the_map_style_pipeline_does(chat_tokenizer, tmp_path):
    convs = [row["messages"] for row in load_builtin_chat_corpus()["validation"][:30]]
    convs.append([{"role": "user", "content": "Nothing to learn from this one."}])  # dropped: no trained token
    halves = {"train": convs[:20], "validation": convs[20:]}
    kwargs = dict(tokenizer=chat_tokenizer, max_length=160, micro_batch_size=4, strategy="pack")
    whole = SeqMemDataModule(
        dataset=datasets.DatasetDict({k: datasets.Dataset.from_dict({"messages": v}) for k, v in halves.items()}),
        cache_dir=tmp_path / "cache",
        **kwargs,
    )
    stream = datasets.IterableDatasetDict(
        {k: datasets.Dataset.from_dict({"messages": v}).to_iterable_dataset() for k, v in halves.items()}
    )
    dm = SeqMemDataModule(dataset=stream, **kwargs)
    dm.setup("fit")
    with pytest.warns(UserWarning, match="lose tokens"):
        trained = sum(int((batch["labels"] != -100).sum()) for batch in dm.val_dataloader())
    keys = COUNTED + ("conversations_dropped_empty", "trained_tokens")
    got, want = dm.stats()["validation"], whole.stats()["validation"]
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys}
    assert got["tokens_truncated"] > 0 and got["conversations_dropped_empty"] == 1
    assert trained == got["trained_tokens"]  # every trained token counted reaches the loss
    assert (
        "trained_tokens"
        not in SeqMemDataModule(
            dataset=datasets.IterableDataset.from_generator(lambda: ({"text": "a b"} for _ in range(3))),
            strategy="pack",
            streaming_validation_documents=0,
        ).stats()["train"]
    )


def test_shuffled_stream_is_dealt_anew_each_epoch(tokenizer):
    texts = [f"doc {i} " + "word " * (1 + i % 5) for i in range(64)]
    stream = (
        datasets.Dataset.from_dict({"text": texts}).to_iterable_dataset(num_shards=8).shuffle(seed=0, buffer_size=16)
    )
    dm = SeqMemDataModule(
        dataset=stream,
        max_length=32,
        micro_batch_size=4,
        strategy="pack",
        streaming_validation_documents=0,
        streaming_buffer_size=4,
    )
    dm.setup("fit")
    loader = dm.train_dataloader()
    first, second = ([d for b in loader for d in _documents(b, dm.pad_token_id)] for _ in range(2))
    assert sorted(first) == sorted(second) and first != second
    assert dm.stats()["train"]["documents"] == 2 * len(texts)  # counts are of everything read so far


# ------------------------------------------------------------------------------------------------- DDP
def _ddp_rank(rank: int, paths: list[str]) -> dict:
    dist.init_process_group("gloo")  # rank, world size and rendezvous from the environment (_forked_ranks)
    dm = SeqMemDataModule(
        dataset=_stream(paths),
        max_length=24,
        micro_batch_size=4,
        strategy="pack",
        num_workers=2,
        streaming_validation_documents=12,
        streaming_buffer_size=8,
    )
    dm.setup("fit")
    train = dm.train_dataloader()
    train.dataset.cycle = False  # one pass, to compare with the stream (training repeats it under DDP)
    seen = {
        split: [list(d) for batch in loader for d in _documents(batch, dm.pad_token_id)]
        for split, loader in (("train", train), ("validation", dm.val_dataloader()))
    }
    dist.destroy_process_group()
    return {"seen": seen, "stats": dm.stats()}


@pytest.mark.slow
def test_ddp_ranks_and_their_workers_read_disjoint_shards_covering_the_stream(tmp_path, tokenizer):
    """2 ranks x 2 workers over 4 files: each (rank, worker) reads one train file; validation is read whole by each
    rank and its rows dealt out; each document reaches one rank once."""
    paths = _write_shards(tmp_path)
    ranks = run_ranks(_ddp_rank, paths)
    seen = [tuple(d) for r in ranks for split in ("train", "validation") for d in r["seen"][split]]
    whole = SeqMemDataModule(
        dataset=datasets.Dataset.from_list([{"text": t} for t in _texts(paths)]), max_length=24, strategy="pack"
    )
    expected = [tuple(d[j : j + 24]) for d in _encoded(whole, paths) for j in range(0, len(d), 24)]
    assert sorted(seen) == sorted(expected)
    train = [r["stats"]["train"]["documents"] for r in ranks]
    assert ranks[0]["stats"]["validation"] == ranks[1]["stats"]["validation"]  # each read all of it
    assert sum(train) + ranks[0]["stats"]["validation"]["documents"] == len(_encoded(whole, paths))
    assert min(train) > 0 and min(len(r["seen"]["validation"]) for r in ranks) > 0


@pytest.mark.slow
def test_uneven_validation_stream_under_fsdp_runs_the_same_batches_on_every_rank(tmp_path):
    """A validation split of one big and one tiny file under Lightning's FSDP (two CPU ranks): split by file, one
    rank would run 13 batches and the other 1, their collective forwards crossing into the next training step.
    Dealt out, both run the same batches, and each counts the whole split."""
    ranks = run_ranks(stream_dist.main, "fsdp", stream_dist.write_files(str(tmp_path)))
    assert ranks[0]["val_batches"] == ranks[1]["val_batches"] > 0
    assert ranks[0]["stats"] == ranks[1]["stats"] and ranks[0]["stats"]["documents"] == 2 * 32  # two validations
    assert ranks[0]["val_loss"] == ranks[1]["val_loss"]


def _prompt_completion_rows(n=30):
    return [
        {
            "prompt": f"question {i} " + "why " * (i % 17),
            "completion": "" if i == 4 else f"answer {i} " + "because " * (i % 11),
        }
        for i in range(n)
    ]


def test_prompt_completion_stream_is_truncated_and_counted_as_the_map_style_rows(tokenizer, tmp_path):
    """Prompt/completion rows streamed: framed, truncated by the same limits (the prompt keeps its end, the
    completion its start), loss on the completion only, the same counts as a ``DatasetDict`` of the same rows."""
    rows = _prompt_completion_rows()
    halves = {"train": rows[:20], "validation": rows[20:]}
    kwargs = dict(max_length=24, max_prompt_length=10, micro_batch_size=4, strategy="pack")
    whole = SeqMemDataModule(
        dataset=datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in halves.items()}),
        cache_dir=tmp_path / "cache",
        **kwargs,
    )
    stream = datasets.IterableDatasetDict(
        {k: datasets.Dataset.from_list(v).to_iterable_dataset() for k, v in halves.items()}
    )
    dm = SeqMemDataModule(dataset=stream, **kwargs)
    dm.setup("fit")
    with pytest.warns(UserWarning, match="train stream: documents longer than max_length=24 lose tokens"):
        batches = list(dm.train_dataloader())
    got, want = dm.stats()["train"], whole.stats()["train"]
    keys = COUNTED + ("rows_without_completion",)
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys}
    assert got["rows_without_completion"] == 1 and got["tokens_truncated"] > 0
    fed = sum(int(real_token_mask(b, dm.pad_token_id).sum()) for b in batches)
    assert fed + got["tokens_truncated"] == got["tokens"]
    # the same rows, token for token, with the same labels (loss on completions only)
    mine = sorted(zip(_documents_with_labels(batches, dm.pad_token_id)))
    theirs = sorted(zip(_documents_with_labels(whole.train_dataloader(), dm.pad_token_id)))
    assert mine == theirs


def _documents_with_labels(batches, pad_token_id):
    out, real = [], None
    for batch in batches:
        real = real_token_mask(batch, pad_token_id)
        for row in range(batch["input_ids"].shape[0]):
            ids, pos, labels = batch["input_ids"][row], batch["position_ids"][row], batch["labels"][row]
            starts = (pos == 0).nonzero().flatten().tolist() + [len(ids)]
            out += [
                (tuple(ids[a:b].tolist()), tuple(labels[a:b].tolist()))
                for a, b in zip(starts[:-1], starts[1:])
                if real[row, a]
            ]
    return out


def test_token_id_stream_is_packed_with_its_labels_and_checked(tokenizer):
    rows = [
        {"input_ids": list(range(1, 5 + i % 40)), "labels": [-100] * 2 + list(range(3, 5 + i % 40))} for i in range(30)
    ]
    stream = datasets.Dataset.from_list(rows).to_iterable_dataset()
    dm = SeqMemDataModule(
        dataset=stream, max_length=24, micro_batch_size=4, strategy="pack", streaming_validation_documents=0
    )
    dm.setup("fit")
    pieces = [p for b in dm.train_dataloader() for p in _documents_with_labels([b], dm.pad_token_id)]
    expected = [
        (tuple(r["input_ids"][j : j + 24]), tuple(r["labels"][j : j + 24]))
        for r in rows
        for j in range(0, len(r["input_ids"]), 24)
    ]
    # a packed piece's first label is -100 (nothing in its row predicts it)
    assert sorted(ids for ids, _ in pieces) == sorted(ids for ids, _ in expected)
    for ids, labels in pieces:
        want = dict(expected)[ids]
        assert labels[1:] == want[1:] and labels[0] == -100
    stats = dm.stats()["train"]
    assert stats["documents"] == 30 and stats["tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert stats["documents_split"] == sum(len(r["input_ids"]) > 24 for r in rows)
    bad = datasets.Dataset.from_list([{"input_ids": [1, 2]}, {"input_ids": [3, len(tokenizer) + 7]}])
    dm = SeqMemDataModule(
        dataset=bad.to_iterable_dataset(), strategy="pack", tokenizer=tokenizer, streaming_validation_documents=0
    )
    dm.setup("fit")
    with pytest.raises(ValueError, match=r"Row 1 of split 'train', column 'input_ids' holds a token id outside"):
        list(dm.train_dataloader())


# ------------------------------------------------------------------------------------------ streaming=True
def test_streaming_true_reads_local_files_lazily_and_every_document_once(tmp_path, tokenizer):
    """``streaming=True`` on jsonl files: ``datasets`` reads them as a stream (no Arrow copy is written), one shard
    per file, and train plus validation are the files' documents, each once."""
    paths = _write_shards(tmp_path)
    dm = SeqMemDataModule(
        dataset=str(tmp_path / "part*.jsonl"),
        streaming=True,
        max_length=24,
        micro_batch_size=4,
        strategy="pack",
        num_workers=2,
        streaming_validation_documents=12,
        cache_dir=tmp_path / "cache",
    )
    dm.prepare_data()
    dm.setup("fit")
    assert isinstance(dm.dataset, datasets.IterableDatasetDict) and dm.dataset["train"].num_shards == 4
    seen, expected, _ = _read_once(dm, paths)
    assert seen == expected
    assert not (tmp_path / "cache").exists()  # nothing tokenized ahead


def test_streaming_true_serves_a_map_style_dataset_as_shards(tokenizer):
    ds = datasets.Dataset.from_dict(
        {"prompt": [f"q {i}" for i in range(40)], "completion": [f"a {i} " + "so " * (i % 9) for i in range(40)]}
    )
    dm = SeqMemDataModule(
        dataset=ds, streaming=True, max_length=32, micro_batch_size=4, strategy="pack", streaming_validation_documents=5
    )
    dm.setup("fit")
    assert dm.dataset["train"].num_shards == 8 and len(dm.datasets["validation"]) == 5
    list(dm.train_dataloader())
    assert dm.stats()["train"]["documents"] == 35 and dm.stats()["train"]["rows_without_completion"] == 0
    with pytest.raises(
        ValueError, match=r"streaming dataset is packed on the fly: use batching=Pack\(\) .*batching=Pad\(\)"
    ):
        SeqMemDataModule(dataset=ds, streaming=True, strategy="pad").setup("fit")


def test_streaming_packer_hands_rows_out_evenly_not_in_bursts():
    """Rows are spread over the documents read while the window fills again, so a loader worker yields batches at
    a steady rate (the DataLoader takes batches from its workers in turn: a burst on one worker stalls the
    others). Nothing is lost or repeated."""
    import random

    rng = random.Random(0)
    docs = [[rng.randrange(100) for _ in range(rng.randrange(20, 60))] for _ in range(2000)]
    read = []

    def source():
        for i, d in enumerate(docs):
            read.append(i)
            yield d

    rows_after = Counter()
    rows = []
    for row in StreamingPacker(256, buffer_size=64)(source(), steady=True):
        rows_after[len(read)] += 1
        rows.append(row)
    steady = [n for at, n in rows_after.items() if at < len(docs)]  # before the final flush
    assert max(steady) == 1 and len(steady) > 200
    assert sorted(t for r in rows for t in r["input_ids"]) == sorted(t for d in docs for t in d)


def test_stream_layouts_that_waste_reading_are_named():
    from lightning_seqmem.streams.reading import layout_warnings

    assert layout_warnings("train", 8, 4, 2) == []  # 2 files per rank, one per worker
    (uneven,) = layout_warnings("train", 6, 4, 2)  # each rank then reads all 6 files: enough for 2 workers
    assert "6 files (shards) cannot be dealt evenly to 4 ranks" in uneven and "4x the reading" in uneven
    (idle,) = layout_warnings("train", 4, 2, 3)
    assert "3 loader workers but 2 file(s) (shards) per rank" in idle and "1 worker(s) read nothing" in idle
    assert layout_warnings("validation", None, 2, 4) == []  # a list held in memory has no shards


def test_more_workers_than_files_is_warned_through_the_datamodule(tmp_path, tokenizer):
    paths = _write_shards(tmp_path, shards=2, per_shard=10)
    dm = SeqMemDataModule(
        dataset=paths, streaming=True, strategy="pack", max_length=24, num_workers=3, streaming_validation_documents=0
    )
    dm.setup("fit")
    with pytest.warns(UserWarning, match=r"3 loader workers but 2 file\(s\) \(shards\) per rank"):
        dm.train_dataloader()


def test_a_stream_is_planned_on_its_first_documents(tmp_path, tokenizer):
    """``seqmem-plan`` on a stream plans on a map-style copy of its head: with every document in the head, the same
    plan as the map-style DataModule over the same files; with fewer, the plan of those."""
    from lightning_seqmem.apps.plan_lengths import stream_sample
    from lightning_seqmem.apps.planner import plan

    paths = _write_shards(tmp_path, shards=2)
    kwargs = dict(strategy="pack", max_length=24, cache_dir=tmp_path / "cache")

    def summary(result):
        return [(s.strategy, s.max_length, s.tokens_lost, round(s.token_efficiency, 6)) for s in result.strategies]

    streamed = plan(SeqMemDataModule(dataset=paths, streaming=True, **kwargs), max_lengths=[24, 48])
    assert summary(streamed) == summary(plan(SeqMemDataModule(dataset=paths, **kwargs), max_lengths=[24, 48]))
    head, read = stream_sample(SeqMemDataModule(dataset=paths, streaming=True, **kwargs), documents=10)
    assert read == 10 and not head.settings.data.streaming and len(head.tokenized_documents()[0]["train"]) == 10


def test_pretokenized_prompt_completion_stream_matches_the_map_style_rows(tokenizer, tmp_path):
    rows = [
        {"prompt_ids": list(range(5, 8 + i % 19)), "completion_ids": list(range(40, 40 + (i * 7) % 23))}
        for i in range(30)
    ]  # i = 0, 23: an empty completion
    halves = {"train": rows[:20], "validation": rows[20:]}
    kwargs = dict(
        max_length=24, max_prompt_length=10, micro_batch_size=4, strategy="pack", pad_token_id=0, eos_token_id=1
    )
    whole = SeqMemDataModule(
        dataset=datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in halves.items()}),
        cache_dir=tmp_path / "cache",
        **kwargs,
    )
    dm = SeqMemDataModule(
        dataset=datasets.IterableDatasetDict(
            {k: datasets.Dataset.from_list(v).to_iterable_dataset() for k, v in halves.items()}
        ),
        **kwargs,
    )
    dm.setup("fit")
    assert dm.tokenizer is None  # pre-tokenized with its pad id: no tokenizer loaded
    mine = sorted(_documents_with_labels(dm.train_dataloader(), 0))
    assert mine == sorted(_documents_with_labels(whole.train_dataloader(), 0))
    keys = COUNTED + ("rows_without_completion",)
    got, want = dm.stats()["train"], whole.stats()["train"]
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys} and got["rows_without_completion"] == 1


def test_a_stream_with_nothing_left_to_train_on_is_a_clear_error(tokenizer):
    small = datasets.Dataset.from_dict({"text": [f"doc {i}" for i in range(5)]}).to_iterable_dataset()
    with pytest.raises(
        ValueError,
        match=r"The stream holds 5 documents, and the first "
        r"streaming_validation_documents=100 go to validation",
    ):
        SeqMemDataModule(dataset=small, strategy="pack").setup("fit")
    empty = datasets.IterableDatasetDict(
        {
            split: datasets.Dataset.from_dict({"text": [""] * 4}).to_iterable_dataset()
            for split in ("train", "validation")
        }
    )
    dm = SeqMemDataModule(dataset=empty, strategy="pack")
    dm.setup("fit")
    with pytest.raises(ValueError, match=r"training stream holds no document to train on \(0 read, all empty"):
        list(dm.train_dataloader())


def test_a_repeating_stream_with_an_idle_loader_worker_goes_on_with_the_others(tokenizer):
    """Under DDP the train stream repeats; a worker with no file of its own (one file, two workers) stops instead of
    repeating nothing forever, which would hang the DataLoader waiting on it."""
    import itertools

    from torch.utils.data import DataLoader

    from lightning_seqmem.kinds.text import text_stream_encoder
    from lightning_seqmem.streams.counts import StreamCounts
    from lightning_seqmem.streams.rows import StreamingRows

    one_file = datasets.Dataset.from_dict({"text": [f"doc {i} word word" for i in range(20)]}).to_iterable_dataset()
    rows = StreamingRows(
        one_file,
        text_stream_encoder(tokenizer),
        StreamingPacker(16, buffer_size=4),
        cycle=True,
        required=True,
        counts=StreamCounts(2),
    )
    loader = DataLoader(rows, batch_size=None, num_workers=2, timeout=60)
    taken = list(itertools.islice(loader, 60))  # more rows than one pass gives: worker 0 repeats its file
    assert len(taken) == 60


def test_streaming_true_checks_its_files_as_map_style_loading_does(tmp_path, tokenizer):
    """Bad paths fail before training with the map-style messages; a folder streams its files; a list of documents
    is served as a stream too."""
    with pytest.raises(FileNotFoundError, match=r"Dataset path .*nope\.jsonl.* does not exist"):
        SeqMemDataModule(dataset=str(tmp_path / "nope.jsonl"), streaming=True, strategy="pack").setup("fit")
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "one two"}) + "\n")
    (tmp_path / "b.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"Cannot read files with extensions \['.jsonl', '.parquet'\] together"):
        SeqMemDataModule(
            dataset=[str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")], streaming=True, strategy="pack"
        ).setup("fit")
    (tmp_path / "b.parquet").unlink()
    (tmp_path / "c.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"c\.jsonl is empty"):
        SeqMemDataModule(dataset=str(tmp_path), streaming=True, strategy="pack").setup("fit")
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "three four five"}) + "\n")
    folder = SeqMemDataModule(dataset=str(tmp_path), streaming=True, strategy="pack", streaming_validation_documents=0)
    folder.setup("fit")
    assert folder.dataset["train"].num_shards == 2 and len(list(folder.train_dataloader())) == 1
    documents = SeqMemDataModule(
        dataset=["alpha beta", "gamma delta", "epsilon"],
        streaming=True,
        strategy="pack",
        streaming_validation_documents=1,
    )
    documents.setup("fit")
    assert isinstance(documents.dataset, datasets.IterableDatasetDict) and documents.datasets["validation"]


def test_stream_files_that_disagree_are_named_before_training(tmp_path):
    """``datasets`` reads every file of a stream with the first file's columns and fails mid-training, naming no
    file, on one that disagrees: the files are checked when the stream is opened (first rows, Parquet schemas), and
    the error names the files, the columns and the fix. Files whose columns the first file holds stream as before."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def jsonl(name, *rows):
        (tmp_path / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
        return str(tmp_path / name)

    text, content = jsonl("a.jsonl", {"text": "one two"}), jsonl("b.jsonl", {"content": "three four"})
    listed, fuller = jsonl("c.jsonl", {"text": ["five"]}), jsonl("d.jsonl", {"text": "six seven", "id": 1})

    def setup(files):
        dm = SeqMemDataModule(dataset=files, streaming=True, strategy="pack", streaming_validation_documents=0)
        dm.setup("fit")
        return dm

    with pytest.raises(ValueError, match=r"b\.jsonl has column\(s\) \['content'\] that .*a\.jsonl lacks \(and lacks "):
        setup([text, content])
    with pytest.raises(ValueError, match=r"c\.jsonl's column 'text' holds a list where .*a\.jsonl's holds a single"):
        setup([text, listed])
    with pytest.raises(ValueError, match=r"d\.jsonl has column\(s\) \['id'\].*Give every file the same columns"):
        setup([text, fuller])
    agreeing = setup([fuller, text])  # a file without the first file's 'id' is read with id None
    assert sum(1 for _ in agreeing.train_dataloader()) and agreeing.stats()["train"]["documents"] == 2
    parquet = []
    for name, table in (("p.parquet", {"text": ["a b"]}), ("q.parquet", {"text": [["c"]]})):
        pq.write_table(pa.table(table), tmp_path / name)
        parquet.append(str(tmp_path / name))
    with pytest.raises(ValueError, match=r"q\.parquet's column 'text' holds a list where .*p\.parquet's holds"):
        setup(parquet)
