"""Streams resume exactly where they stopped: the loader's state (per worker, the batch Lightning fetched ahead),
through real Trainers and checkpoints, with another number of workers (no document lost or repeated), and a
changed stream refused."""

import glob
import json
import os

import datasets
import lightning.pytorch as L
import pytest
import torch
from _recorder import Recorder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_seqmem import SeqMemDataModule

FIRST = 1000  # pre-tokenized documents: token FIRST + i opens document i, so every packed segment names its document


def _write_text_shards(directory, shards=4, per_shard=40):
    os.makedirs(directory, exist_ok=True)
    for s in range(shards):
        with open(os.path.join(directory, f"part{s}.jsonl"), "w") as f:
            for i in range(per_shard):
                f.write(json.dumps({"text": f"shard {s} doc {i} " + "word " * (1 + (i * 7 + s) % 23)}) + "\n")
    return sorted(glob.glob(os.path.join(directory, "*.jsonl")))


def _id_stream(documents=120, shards=4):
    """Token-id documents of varied lengths as a stream of ``shards`` shards; document i starts with FIRST + i."""
    rows = [[FIRST + i] + [5 + (i * 13 + j) % 90 for j in range(1 + (i * 7) % 29)] for i in range(documents)]
    return datasets.Dataset.from_dict({"input_ids": rows}).to_iterable_dataset(num_shards=shards)


def _dm(dataset, workers=0, buffer=6, **kw):
    args = dict(max_length=48, micro_batch_size=2, strategy="pack", num_workers=workers, streaming_buffer_size=buffer)
    if not isinstance(dataset, datasets.IterableDataset) or "input_ids" not in (dataset.features or {}):
        args["streaming"] = True
    else:
        args.update(pad_token_id=0, streaming_validation_documents=0)
    return SeqMemDataModule(dataset=dataset, **{**args, **kw})


def _as_lists(batch):
    return {k: v.tolist() for k, v in batch.items()}


def _documents(batches):
    """The documents (by their first token) in packed batches, in order."""
    out = []
    for batch in batches:
        for ids, pos in zip(batch["input_ids"], batch["position_ids"]):
            out += [t for t, p in zip(ids, pos) if p == 0 and t >= FIRST]
    return out


# ----------------------------------------------------------------------------------- the loader, cut anywhere
_FULL: dict = {}  # the uninterrupted epoch of each loader setting, read once for every example that draws it


def _uninterrupted(key, loader):
    if key not in _FULL:
        _FULL[key] = [_as_lists(b) for b in loader()]
    return _FULL[key]


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cut=st.integers(0, 40),
    buffer=st.sampled_from([1, 3, 8]),
    shards=st.sampled_from([1, 3, 4]),
    shuffle=st.sampled_from([0, 5]),
)
def test_a_stream_loader_cut_anywhere_goes_on_with_the_same_batches(cut, buffer, shards, shuffle):
    """The packing window, the shard positions and the shuffle buffer: all of it comes back."""

    def dm():
        return _dm(_id_stream(shards=shards), buffer=buffer, streaming_shuffle_buffer=shuffle)

    full = _uninterrupted((buffer, shards, shuffle), lambda: dm().train_dataloader())
    cut = min(cut, len(full))
    loader = dm().train_dataloader()
    it = iter(loader)
    head = [_as_lists(next(it)) for _ in range(cut)]
    state = loader.state_dict()
    again = dm().train_dataloader()
    again.load_state_dict(state)
    assert head + [_as_lists(b) for b in again] == full


@pytest.mark.slow
@settings(max_examples=4, deadline=None)
@given(cut=st.integers(0, 30))
def test_a_stream_loader_with_two_workers_cut_anywhere_goes_on_with_the_same_batches(cut):
    full = _uninterrupted(("workers", 2), lambda: _dm(_id_stream(), workers=2).train_dataloader())
    loader = _dm(_id_stream(), workers=2).train_dataloader()
    it = iter(loader)
    head = [_as_lists(next(it)) for _ in range(min(cut, len(full)))]
    state = loader.state_dict()
    again = _dm(_id_stream(), workers=2).train_dataloader()
    again.load_state_dict(state)
    assert head + [_as_lists(b) for b in again] == full


@pytest.mark.slow  # loader worker processes
@pytest.mark.parametrize("before, after", [(2, 1), (0, 2), (2, 0)])
def test_another_worker_count_reads_every_document_of_the_epoch_once(before, after):
    """Regrouped readers: the batches differ (rows in flight are packed again), the documents do not (those in the
    shuffle buffers included)."""
    full = _uninterrupted(("workers", before), lambda: _dm(_id_stream(), workers=before).train_dataloader())
    loader = _dm(_id_stream(), workers=before, streaming_shuffle_buffer=4).train_dataloader()
    it = iter(loader)
    head = [_as_lists(next(it)) for _ in range(7)]
    state = loader.state_dict()
    again = _dm(_id_stream(), workers=after, streaming_shuffle_buffer=4).train_dataloader()
    again.load_state_dict(state)
    rest = [_as_lists(b) for b in again]
    assert sorted(_documents(head + rest)) == sorted(_documents(full)) == list(range(FIRST, FIRST + 120))


# ------------------------------------------------------------------------------------------- real Trainers
def _fit(dm, max_steps, root, ckpt=None, save=False, model=None, **trainer):
    model = model or Recorder()
    callbacks = trainer.pop("callbacks", [])
    if save:
        callbacks.append(L.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1))
    t = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
        enable_checkpointing=any(isinstance(c, L.callbacks.ModelCheckpoint) for c in callbacks),
        default_root_dir=root,
        **trainer,
    )
    t.fit(model, datamodule=dm, ckpt_path=ckpt)
    return model, t


@pytest.mark.parametrize(
    "workers", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)]
)
def test_a_run_resumed_from_a_checkpoint_trains_on_the_batches_of_the_uninterrupted_run(tmp_path, workers):
    """Lightning fetches one batch ahead of a stream: the checkpoint keeps it, and the resumed run trains on it."""
    files = _write_text_shards(tmp_path / "data")
    whole = _dm(files, workers)
    full, _ = _fit(whole, 10, tmp_path / "full", save=True)
    dm = _dm(files, workers)
    resumed, _ = _fit(dm, 10, tmp_path / "resumed", ckpt=str(tmp_path / "full" / "epoch=0-step=4.ckpt"))
    assert resumed.seen == full.seen[4:]
    cut = torch.load(tmp_path / "full" / "epoch=0-step=4.ckpt", weights_only=True)
    assert cut["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["ranks"][0]["ahead"]  # the fetched batch
    # the counts go on from the cut, not restarted or doubled (loader workers count what they have read ahead)
    if workers == 0:
        assert dm.stats()["train"] == whole.stats()["train"]
    else:
        states = cut["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["ranks"][0]["loader"]["_snapshot"]
        at_cut = sum(w["dataset_state"]["counts"][0] for w in states["_worker_snapshots"].values())
        assert at_cut < dm.stats()["train"]["documents"] <= 1.2 * whole.stats()["train"]["documents"]


def test_a_cut_in_a_later_epoch_resumes_into_that_epoch_exactly(tmp_path):
    files = _write_text_shards(tmp_path / "data", shards=2, per_shard=12)
    full, trainer = _fit(_dm(files, streaming_validation_documents=4), 30, tmp_path / "full", save=True)
    assert trainer.current_epoch >= 2  # the stream was read more than once
    name = next(p.name for p in sorted((tmp_path / "full").glob("epoch=1-*.ckpt"), key=os.path.getmtime)[1:])
    step = int(name.split("step=")[1].split(".")[0])
    resumed, _ = _fit(
        _dm(files, streaming_validation_documents=4), 30, tmp_path / "r", ckpt=str(tmp_path / "full" / name)
    )
    assert resumed.seen == full.seen[step:]


@pytest.mark.slow
def test_resume_is_exact_with_warmup_accumulation_and_a_real_model(tmp_path):
    from lightning_seqmem import CausalLM, SeqLengthWarmup

    files = _write_text_shards(tmp_path / "data", per_shard=80)  # the cut mid-epoch

    def run(root, ckpt=None, save=False):
        torch.manual_seed(0)
        model = CausalLM(model_config="tiny_llama", learning_rate=1e-3)
        warmup = SeqLengthWarmup(duration=0.5, min_seq_length=8, max_seq_length=48)
        kw = dict(accumulate_grad_batches=2, callbacks=[warmup], gradient_clip_val=1.0)
        return _fit(_dm(files, 0, buffer=4), 8, root, ckpt=ckpt, save=save, model=model, **kw)[0]

    full = run(tmp_path / "full", save=True)
    resumed = run(tmp_path / "resumed", ckpt=str(tmp_path / "full" / "epoch=0-step=3.ckpt"))
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_a_streamed_conversation_run_resumes_exactly(tmp_path):
    def dm():
        return SeqMemDataModule(
            dataset="builtin_chat", streaming=True, max_length=96, micro_batch_size=2, streaming_buffer_size=4
        )

    full, _ = _fit(dm(), 6, tmp_path / "full", save=True)
    resumed, _ = _fit(dm(), 6, tmp_path / "resumed", ckpt=str(tmp_path / "full" / "epoch=0-step=2.ckpt"))
    assert resumed.seen == full.seen[2:]


def test_a_changed_file_list_is_refused_naming_it_or_restarts_the_epoch(tmp_path):
    files = _write_text_shards(tmp_path / "data")
    _fit(_dm(files), 3, tmp_path / "full", save=True)
    ckpt = str(tmp_path / "full" / "epoch=0-step=2.ckpt")
    with pytest.raises(ValueError, match=r"stream_files.*on_resume_mismatch='restart_epoch'"):
        _fit(_dm(files[:3]), 4, tmp_path / "other", ckpt=ckpt)
    fresh, _ = _fit(_dm(files[:3]), 2, tmp_path / "fresh")
    with pytest.warns(UserWarning, match="the current epoch restarts from its first batch"):
        restarted, _ = _fit(_dm(files[:3], on_resume_mismatch="restart_epoch"), 4, tmp_path / "r", ckpt=ckpt)
    assert restarted.seen == fresh.seen


def test_a_pretokenized_stream_without_a_tokenizer_trains_under_fit(tmp_path):
    dm = _dm(_id_stream())
    _fit(dm, 2, tmp_path)
    assert dm.tokenizer is None and dm.stats()["train"]["documents"] > 0


@pytest.mark.slow  # loader worker processes
@pytest.mark.parametrize("before, after", [(2, 1), (0, 2)])
def test_a_map_style_run_resumes_with_another_worker_count_exactly(small_text_dataset, tmp_path, before, after):
    """The batches are the sampler's, whatever the workers: the resumed run trains on the uninterrupted run's (was
    a bare AssertionError in torchdata, shown as Lightning's "call iter(combined_loader) first")."""

    def dm(workers):
        return SeqMemDataModule(
            dataset=small_text_dataset, max_length=32, micro_batch_size=2, strategy="pack", num_workers=workers
        )

    full, _ = _fit(dm(before), 8, tmp_path / "full", save=True)
    resumed, _ = _fit(dm(after), 8, tmp_path / "resumed", ckpt=str(tmp_path / "full" / "epoch=0-step=3.ckpt"))
    assert resumed.seen == full.seen[3:]


# ------------------------------------------------------------------------------------- ranks, and SIGKILL
class _Batches(Recorder):
    """Records whole batches (ids and positions: each document by its first token)."""

    def training_step(self, batch, batch_idx):
        self.seen.append({k: batch[k].tolist() for k in ("input_ids", "position_ids")})
        return (self.w * batch["input_ids"].float().mean()).sum()


def _rank_run(rank, root, max_steps, ckpt, save):
    model, _ = _fit(
        _dm(_id_stream()), max_steps, root, ckpt=ckpt, save=save, model=_Batches(), strategy="ddp", devices=2
    )
    return model.seen


@pytest.mark.slow
def test_two_ranks_resume_exactly_and_one_rank_goes_on_with_every_document(tmp_path):
    from _forked_ranks import run_ranks

    full = run_ranks(_rank_run, tmp_path / "full", 6, None, True)
    ckpt = str(tmp_path / "full" / "epoch=0-step=2.ckpt")
    resumed = run_ranks(_rank_run, tmp_path / "resumed", 6, ckpt, False)
    assert [r for r in resumed] == [f[2:] for f in full]
    # one rank now: the two ranks' positions are dealt to it; the epoch reads each document once
    alone, _ = _fit(_dm(_id_stream()), -1, tmp_path / "alone", ckpt=ckpt, model=_Batches(), max_epochs=1)
    before = [batch for rank in full for batch in rank[:2]]
    documents = _documents(before + alone.seen)  # the batches fetched ahead of the cut come first in alone.seen
    assert sorted(documents) == list(range(FIRST, FIRST + 120))


def _killed_run(files, root, log, kill_at):
    import hashlib
    import signal

    class Log(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if kill_at is not None and trainer.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # preempted between two checkpoints, mid-stream
            with open(log, "a") as f:
                f.write(hashlib.sha1(batch["input_ids"].numpy().tobytes()).hexdigest() + "\n")

    every_two = L.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1)
    ckpts = sorted(glob.glob(os.path.join(root, "*.ckpt")), key=os.path.getmtime)
    _fit(_dm(files, workers=2), 9, root, ckpt=ckpts[-1] if ckpts else None, callbacks=[Log(), every_two])


@pytest.mark.slow
def test_a_run_killed_with_sigkill_resumes_from_its_last_checkpoint_exactly(tmp_path):
    import multiprocessing as mp

    files = _write_text_shards(tmp_path / "data")
    context = mp.get_context("fork")
    child = context.Process(target=_killed_run, args=(files, str(tmp_path / "run"), tmp_path / "killed.log", 5))
    child.start()
    child.join(120)
    assert child.exitcode == -9  # killed by the signal, not stopped
    assert sorted(p.name for p in (tmp_path / "run").glob("*.ckpt")) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    again = context.Process(target=_killed_run, args=(files, str(tmp_path / "run"), tmp_path / "resumed.log", None))
    again.start()
    again.join(120)
    assert again.exitcode == 0
    _killed_run(files, str(tmp_path / "full"), tmp_path / "full.log", None)
    full = (tmp_path / "full.log").read_text().split()
    assert (tmp_path / "resumed.log").read_text().split() == full[4:]
    assert (tmp_path / "killed.log").read_text().split() == full[:5]


def test_the_shuffle_buffer_draws_another_order_of_the_same_documents():
    in_order = _documents(_as_lists(b) for b in _dm(_id_stream(), buffer=1).train_dataloader())
    drawn = _documents(_as_lists(b) for b in _dm(_id_stream(), buffer=1, streaming_shuffle_buffer=8).train_dataloader())
    assert drawn != in_order and sorted(drawn) == sorted(in_order)
    with pytest.raises(ValueError, match="streaming_shuffle_buffer must be an int >= 0, got -1"):
        SeqMemDataModule(streaming_shuffle_buffer=-1)


def _generated():
    for i in range(200):
        yield {"input_ids": [FIRST + i] + [7] * (1 + i % 31)}


def test_a_generator_stream_cannot_seek_says_so_once_and_still_resumes_exactly():
    def dm():
        stream = datasets.IterableDataset.from_generator(_generated)
        return _dm(stream, pad_token_id=0, streaming_validation_documents=0)

    full = [_as_lists(b) for b in dm().train_dataloader()]
    loader = dm().train_dataloader()
    it = iter(loader)
    head = [_as_lists(next(it)) for _ in range(len(full) // 2)]
    again = dm()
    again.setup("fit")
    resumed = again.train_dataloader()
    resumed.load_state_dict(loader.state_dict())
    with pytest.warns(UserWarning, match=r"cannot seek .* reads \d+ documents again") as said:
        rest = [_as_lists(b) for b in resumed]
    assert sum("cannot seek" in str(w.message) for w in said) == 1
    assert head + rest == full


def _source(kind, directory):
    """The same kind of shards written as ``kind``: what ``dataset=`` is given."""
    os.makedirs(directory, exist_ok=True)
    texts = [[f"shard {s} doc {i} " + "word " * (1 + (i * 7 + s) % 23) for i in range(30)] for s in range(3)]
    if kind == "builtin":
        return "builtin"
    if kind == "parquet":
        for s, part in enumerate(texts):
            datasets.Dataset.from_dict({"text": part}).to_parquet(os.path.join(directory, f"p{s}.parquet"))
        return os.path.join(directory, "*.parquet")
    if kind == "txt":
        for s, part in enumerate(texts):
            with open(os.path.join(directory, f"t{s}.txt"), "w") as f:
                f.write("\n".join(part) + "\n")
        return sorted(glob.glob(os.path.join(directory, "*.txt")))
    if kind == "prompt_completion":
        with open(os.path.join(directory, "pc.jsonl"), "w") as f:
            for part in texts:
                for t in part:
                    f.write(json.dumps({"prompt": t[:12], "completion": t[12:]}) + "\n")
        return os.path.join(directory, "pc.jsonl")
    files = _write_text_shards(directory, shards=3, per_shard=30)
    return datasets.load_dataset("json", data_files=files, split="train", streaming=True)  # a datasets stream


@pytest.mark.parametrize("kind", ["parquet", "txt", "prompt_completion", "datasets_stream", "builtin"])
def test_every_kind_of_source_resumes_exactly(tmp_path, kind):
    source = _source(kind, tmp_path)

    def loader():
        return _dm(source, streaming_validation_documents=4).train_dataloader()

    full = [_as_lists(b) for _, b in zip(range(40), loader())]
    first = loader()
    it = iter(first)
    head = [_as_lists(next(it)) for _ in range(7)]
    again = loader()
    again.load_state_dict(first.state_dict())
    assert head + [_as_lists(b) for _, b in zip(range(33), again)] == full


def test_a_checkpoint_at_the_end_of_an_epoch_resumes_into_the_next_epoch_exactly(tmp_path):
    files = _write_text_shards(tmp_path / "data", shards=2, per_shard=12)
    at_end = L.callbacks.ModelCheckpoint(dirpath=tmp_path / "full", every_n_epochs=1, save_top_k=-1)
    full, _ = _fit(_dm(files, streaming_validation_documents=4), 14, tmp_path / "full", callbacks=[at_end])
    name = sorted(p.name for p in (tmp_path / "full").glob("epoch=0-*.ckpt"))[0]
    step = int(name.split("step=")[1].split(".")[0])
    resumed, t = _fit(
        _dm(files, streaming_validation_documents=4), 14, tmp_path / "r", ckpt=str(tmp_path / "full" / name)
    )
    assert resumed.seen == full.seen[step:] and t.current_epoch >= 1


def test_a_big_line_file_is_cut_into_ranges_a_resume_seeks_to(tmp_path, monkeypatch):
    """One jsonl file becomes many shards (dealt to workers like files), and a resumed reader opens its range at
    its byte offset: the rows before the cut are not read again beyond one range, and nothing is said about it."""
    import lightning_seqmem.data.line_ranges as line_ranges

    monkeypatch.setattr(line_ranges, "CHUNK_BYTES", 600)
    files = _write_text_shards(tmp_path, shards=1, per_shard=120)
    ranges = line_ranges.line_ranges(files)
    assert len(ranges) > 4 and ranges[0][1] == 0 and ranges[-1][2] == os.path.getsize(files[0])
    assert all(a[2] == b[1] for a, b in zip(ranges, ranges[1:]))  # contiguous, each on a line
    rows = list(line_ranges.read_ranges(ranges, "json"))
    assert [r["text"] for r in rows] == [json.loads(line)["text"] for line in open(files[0])]

    def loader():
        return _dm(files, workers=0, streaming_validation_documents=4).train_dataloader()

    full = [_as_lists(b) for b in loader()]
    first = loader()
    it = iter(first)
    head = [_as_lists(next(it)) for _ in range(len(full) * 3 // 4)]
    again = loader()
    again.load_state_dict(first.state_dict())
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "cannot seek"
        rest = [_as_lists(b) for b in again]
    assert head + rest == full
    assert again.dataset.stream.num_shards == len(ranges)


def test_a_bad_line_in_a_streamed_jsonl_file_names_the_file_and_byte(tmp_path):
    from lightning_seqmem.data.line_ranges import read_ranges

    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl: the line at byte 17 is not JSON"):
        list(read_ranges([(str(path), 0, path.stat().st_size)], "json"))


def _map_rank_run(rank, root, dataset):
    dm = SeqMemDataModule(dataset=dataset, max_length=32, micro_batch_size=2, strategy="pack")
    return _fit(dm, 3, root, save=True, strategy="ddp", devices=2)[0].seen


@pytest.mark.slow
def test_a_map_style_checkpoint_of_two_ranks_resumed_on_one_is_refused_naming_the_world_size(
    small_text_dataset, tmp_path
):
    from _forked_ranks import run_ranks

    run_ranks(_map_rank_run, tmp_path / "two", small_text_dataset)
    dm = SeqMemDataModule(dataset=small_text_dataset, max_length=32, micro_batch_size=2, strategy="pack")
    with pytest.raises(ValueError, match=r"world_size: 2 -> 1.*on_resume_mismatch='restart_epoch'"):
        _fit(dm, 6, tmp_path / "one", ckpt=str(tmp_path / "two" / "epoch=0-step=2.ckpt"))


def test_a_repeating_stream_is_dealt_anew_each_pass():
    """Under DDP the train stream repeats (``cycle``): each pass sets the stream's epoch, so a shuffled stream reads
    its documents in another order on its second pass."""
    from collections import Counter

    from lightning_seqmem.batching import StreamingPacker
    from lightning_seqmem.streams.rows import StreamingRows

    stream = _id_stream(documents=40, shards=2).shuffle(seed=0, buffer_size=8)
    rows = StreamingRows(stream, lambda i, ex, counts: ex["input_ids"], StreamingPacker(48, 1), cycle=True)
    firsts = [row["input_ids"][0] for _, row in zip(range(200), rows)]
    passes = [firsts[i : i + 40] for i in range(0, 80, 40)]
    assert Counter(passes[0]) == Counter(range(FIRST, FIRST + 40)) and passes[0] != passes[1]


def test_ranks_that_each_read_every_shard_regroup_their_own_readers_only():
    """3 shards, 2 ranks: every rank reads every shard and keeps every other document. Resumed with 2 loader
    workers per rank instead of none, each rank goes on from its own place: no document lost or read twice."""
    from torch.utils.data import DataLoader

    from lightning_seqmem.batching import StreamingPacker
    from lightning_seqmem.streams.counts import StreamCounts
    from lightning_seqmem.streams.regroup import Regrouped
    from lightning_seqmem.streams.rows import StreamingRows

    def rows(rank, workers=0):
        packer = StreamingPacker(48, 3)
        encode = lambda i, ex, counts: ex["input_ids"]  # noqa: E731
        return StreamingRows(_id_stream(shards=3), encode, packer, counts=StreamCounts(workers), rank=rank, world=2)

    before, saved = [], []
    for rank in range(2):
        reader = rows(rank)
        it = iter(reader)
        before += [next(it) for _ in range(6)]
        saved.append(reader.state_dict())
        assert saved[-1]["layout"]["shards"] == 3 and saved[-1]["rank"] == rank
    after = []
    for rank in range(2):
        reader = rows(rank, workers=2)
        reader.regrouped = Regrouped(saved, StreamCounts.FIELDS)
        after += list(DataLoader(reader, batch_size=None, num_workers=2))
    firsts = [t for row in before + after for t, n in zip(row["input_ids"], _starts(row["seq_lengths"])) if n]
    assert sorted(firsts) == list(range(FIRST, FIRST + 120))


def _starts(lengths):
    """For each token of a packed row, whether a document starts there."""
    return [i == 0 for n in lengths for i in range(n)]


def _cuts_on_a_rank(rank, cuts, batches=30):
    """One of two gloo ranks: for each cut, a loader stopped there, its (gathered) state loaded into a new one,
    and every later batch compared with the uninterrupted run's."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        full = [_as_lists(b) for _, b in zip(range(batches), _dm(_id_stream()).train_dataloader())]
        for cut in cuts:
            loader = _dm(_id_stream()).train_dataloader()
            it = iter(loader)
            head = [_as_lists(next(it)) for _ in range(cut)]
            state = loader.state_dict()  # a collective: every rank's position
            assert len(state["ranks"]) == 2
            again = _dm(_id_stream()).train_dataloader()
            again.load_state_dict(state)
            assert head + [_as_lists(b) for _, b in zip(range(batches - cut), again)] == full, cut
        return len(full)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@settings(max_examples=3, deadline=None)
@given(cuts=st.lists(st.integers(0, 29), min_size=1, max_size=3))
def test_two_ranks_cut_anywhere_go_on_with_the_same_batches(cuts):
    from _forked_ranks import run_ranks

    assert run_ranks(_cuts_on_a_rank, cuts) == [30, 30]
