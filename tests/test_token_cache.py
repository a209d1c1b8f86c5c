"""Tokenize once per node: prepare_data (local rank 0) tokenizes, every rank's setup reads the cache; a different
tokenizer (content, not name) tokenizes again; setup alone (no prepare_data) still works."""

import os
import pickle
from pathlib import Path

import datasets
import lightning.pytorch as L
import pytest
import torch
from _forked_ranks import run_ranks
from transformers import PreTrainedTokenizerFast

from lightning_seqmem.data.backend import tokenizer_fingerprint
from lightning_seqmem.data.cache_dir import default_cache_dir
from lightning_seqmem.datamodule.module import SeqMemDataModule
from lightning_seqmem.kinds.text import Text

TEXT = Text()


class CountingTokenizer(PreTrainedTokenizerFast):
    """A real fast tokenizer that appends its process id to ``marker`` on every call (works across processes)."""

    marker: str | None = None

    def __call__(self, *args, **kwargs):
        with open(self.marker, "a") as f:
            f.write(f"{os.getpid()}\n")
        return super().__call__(*args, **kwargs)


def _counting(tokenizer, tmp_path, name, extra_token=None):
    path = tmp_path / name
    tokenizer.save_pretrained(path)
    tok = CountingTokenizer.from_pretrained(path)
    if extra_token:
        tok.add_tokens([extra_token])
    tok.marker = str(tmp_path / f"{name}.calls")
    return tok


def _calls(tok):
    return open(tok.marker).read().split() if os.path.exists(tok.marker) else []


def _data():
    return datasets.Dataset.from_dict({"text": [f"doc {i} " + "alpha beta " * (1 + i % 9) for i in range(48)]})


class _Steps(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        return (self.w * batch["input_ids"].float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit_on_rank(rank, dm, tmp_path):
    """One of two forked ranks (``_forked_ranks``) under Lightning's DDP: prepare_data on local rank 0 only."""
    trainer = L.Trainer(
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(_Steps(), datamodule=dm)
    assert trainer.global_rank == rank


@pytest.mark.slow
def test_two_ranks_tokenize_once_and_a_new_tokenizer_invalidates_the_cache(tmp_path, tokenizer):
    tok = _counting(tokenizer, tmp_path, "tok")
    cache = tmp_path / "cache"
    dm = SeqMemDataModule(
        dataset=_data(), tokenizer=tok, strategy="pack", max_length=32, micro_batch_size=2, cache_dir=cache, num_proc=1
    )
    run_ranks(_fit_on_rank, dm, tmp_path)
    calls = _calls(tok)
    assert calls and len(set(calls)) == 1  # one process tokenized (local rank 0 in prepare_data); rank 1 read
    assert len(list((cache / "tokenized").iterdir())) == 1  # one cached split (validation is carved out later)

    again = SeqMemDataModule(dataset=_data(), tokenizer=tok, strategy="pack", max_length=32, cache_dir=cache)
    again.setup("fit")  # no prepare_data: setup finds the cache on its own
    assert _calls(tok) == calls

    other = _counting(tokenizer, tmp_path, "other", extra_token="alpha")  # same name and class, other content
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tok)
    changed = SeqMemDataModule(dataset=_data(), tokenizer=other, strategy="pack", max_length=32, cache_dir=cache)
    changed.setup("fit")
    assert _calls(other) and len(list((cache / "tokenized").iterdir())) == 2
    assert changed.stats()["train"]["tokens"] < again.stats()["train"]["tokens"]  # "alpha" is one token now


def test_setup_alone_tokenizes_and_num_proc_gives_the_same_tokens(tmp_path, tokenizer):
    ids = {}
    for procs in (1, 2):
        dm = SeqMemDataModule(
            dataset=_data(), tokenizer=tokenizer, cache_dir=tmp_path / f"c{procs}", num_proc=procs, max_length=512
        )
        dm.setup("fit")  # plain Python use: no prepare_data
        ids[procs] = [
            r.tolist()
            for r in (dm.read_mode.rows["train"][i]["input_ids"] for i in range(len(dm.read_mode.rows["train"])))
        ]
    assert ids[1] == ids[2] and len(ids[1]) > 0


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "lightning_seqmem"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir().parts[-2:] == (".cache", "lightning_seqmem")


def _file_dataset(tmp_path, texts, batch_rows=5):
    import pyarrow as pa

    schema = pa.schema([("text", pa.string())])
    path = tmp_path / "texts.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for lo in range(0, len(texts), batch_rows):
            writer.write_batch(pa.record_batch([pa.array(texts[lo : lo + batch_rows], pa.string())], schema=schema))
    return datasets.Dataset.from_file(str(path))


def test_streamed_tokenization_equals_datasets_map_for_files_shuffles_and_processes(tmp_path, tokenizer):
    from lightning_seqmem.data.encode import tokenize_dataset
    from lightning_seqmem.data.token_cache import tokenize_cached

    texts = [f"row {i}: " + "gamma delta " * (i % 11) for i in range(61)]
    texts[7] = ""  # an empty document stays a row of length 0
    on_disk = _file_dataset(tmp_path, texts)
    for name, ds in {"file": on_disk, "shuffled": on_disk.shuffle(seed=1), "memory": _data()}.items():
        dsd = datasets.DatasetDict({"train": ds})
        reference = tokenize_dataset(dsd, tokenizer, TEXT)["train"]
        for procs in (1, 2):
            cached = tokenize_cached(dsd, tokenizer, TEXT, num_proc=procs, cache_dir=tmp_path / f"{name}-{procs}")[
                "train"
            ]
            assert cached["input_ids"] == reference["input_ids"], (name, procs)
            assert cached["length"] == [len(x) for x in reference["input_ids"]]
            assert cached.features == reference.features


def test_a_bad_row_is_named_from_a_worker_and_nothing_is_cached(tmp_path, tokenizer):
    import pytest

    from lightning_seqmem.data.token_cache import tokenize_cached

    texts = [f"row {i}" for i in range(40)]
    texts[33] = None
    dsd = datasets.DatasetDict({"train": _file_dataset(tmp_path, texts)})
    with pytest.raises(TypeError, match=r"Row 33 of split 'train', column 'text' is NoneType"):
        tokenize_cached(dsd, tokenizer, TEXT, num_proc=2, cache_dir=tmp_path / "c")
    assert not list((tmp_path / "c").rglob("manifest.json"))


def test_an_empty_split_is_cached_with_its_columns(tmp_path, tokenizer):
    from lightning_seqmem.data.token_cache import tokenize_cached

    empty = datasets.Dataset.from_dict({"text": []}, features=datasets.Features({"text": datasets.Value("string")}))
    cached = tokenize_cached(datasets.DatasetDict({"train": empty}), tokenizer, TEXT, cache_dir=tmp_path)["train"]
    assert len(cached) == 0 and cached.column_names == ["input_ids", "length"]


def test_the_fast_encoder_gives_the_tokenizers_ids_and_steps_aside_when_it_might_not(tokenizer):
    from lightning_seqmem.data.encode import batch_encoder

    texts = ["plain words", "", "Ünïcödé\n\n  spaced", "alpha " * 50]
    expected = tokenizer(texts, add_special_tokens=False)["input_ids"]
    fast = batch_encoder(tokenizer)
    assert fast.fast is True and fast(texts) == expected  # the Rust backend's batch call

    class Lowered(type(tokenizer)):  # a user's tokenizer whose __call__ changes the text: must be honoured
        def __call__(self, text, *args, **kwargs):
            return super().__call__([t.lower() for t in text], *args, **kwargs)

    lowered = Lowered(tokenizer_object=tokenizer.backend_tokenizer)
    assert batch_encoder(lowered)(["ABC Def"]) == lowered(["ABC Def"], add_special_tokens=False)["input_ids"]

    truncating = type(tokenizer)(tokenizer_object=tokenizer.backend_tokenizer)
    truncating.backend_tokenizer.enable_truncation(max_length=3)
    try:  # settings pinned in the backend (tokenizer.json) never cut nor pad: a copy of it without them
        encoder = batch_encoder(truncating)
        assert encoder.fast is True and encoder(texts) == expected
    finally:
        truncating.backend_tokenizer.no_truncation()

    class Backend:  # a backend that disagrees with __call__: the first batch is compared, then __call__ is used
        truncation = padding = None
        encode_special_tokens = False

        def encode_batch_fast(self, texts, add_special_tokens):
            return [type("E", (), {"ids": [0]})() for _ in texts]

    class Disagreeing(type(tokenizer)):
        backend_tokenizer = Backend()

    disagreeing = Disagreeing(tokenizer_object=tokenizer.backend_tokenizer)
    encode = batch_encoder(disagreeing)
    assert encode.fast is True
    assert (
        encode(texts) == expected
        and encode(["alpha beta"]) == tokenizer(["alpha beta"], add_special_tokens=False)["input_ids"]
    )
    assert encode.fast is False  # the first batch disagreed: __call__ for good
    assert pickle.loads(pickle.dumps(batch_encoder(tokenizer)))(texts) == expected  # loader workers get a copy


def test_two_writers_of_one_split_each_rename_their_own_file(tmp_path, tokenizer, monkeypatch):
    """Ranks that call setup without prepare_data tokenize the same split into the same directory at once: a writer
    that finishes second must still rename its (identical) file into place, and no temporary file is left."""
    from lightning_seqmem.data import token_cache
    from lightning_seqmem.data.arrow_stream import Shard

    ds = _file_dataset(tmp_path, [f"row {i} " + "alpha " * (i % 5) for i in range(40)])
    job = token_cache._Job(tokenizer, TEXT, ["text"], "text", "train", str(tmp_path / "out"))
    (tmp_path / "out").mkdir()
    real_replace, raced = os.replace, []

    def replace_after_the_other_writer(src, dst):
        if not raced:  # the other rank finishes its whole pass between our write and our rename
            raced.append(True)
            token_cache._tokenize_shard(0, Shard(0, len(ds)), ds, job)
        real_replace(src, dst)

    monkeypatch.setattr(token_cache.os, "replace", replace_after_the_other_writer)
    assert token_cache._tokenize_shard(0, Shard(0, len(ds)), ds, job) == ("tokens-00000.arrow", 40)
    assert raced and sorted(p.name for p in (tmp_path / "out").iterdir()) == ["tokens-00000.arrow"]
    written = datasets.Dataset.from_file(str(tmp_path / "out" / "tokens-00000.arrow"))
    assert written["length"] == [len(ids) for ids in written["input_ids"]] and len(written) == 40


def _tokens(dsd):
    return [list(ids) for ids in dsd["train"]["input_ids"]]


def test_a_writer_killed_mid_file_leaves_nothing_after_the_next_run(tmp_path, tokenizer):
    """SIGKILL in the middle of a cache file (the partial file keeps its temporary name): the next run removes it,
    because its writer is gone, and tokenizes to the same ids."""
    import multiprocessing as mp
    import signal
    import socket

    from lightning_seqmem.data import token_cache
    from lightning_seqmem.data.cache_dir import pid_space

    dsd = datasets.DatasetDict({"train": _file_dataset(tmp_path, [f"row {i} " + "beta " * (i % 7) for i in range(60)])})
    cache = tmp_path / "cache"

    def killed_after_one_batch():
        real = token_cache.iter_shard

        def one_batch_then_die(*args, **kwargs):
            for item in real(*args, **kwargs):
                yield item
                os.kill(os.getpid(), signal.SIGKILL)

        token_cache.iter_shard = one_batch_then_die
        token_cache._TOKENS_PER_RECORD_BATCH = 1  # the first batch reaches the file before the kill
        token_cache.tokenize_cached(dsd, tokenizer, TEXT, num_proc=1, cache_dir=cache)

    child = mp.get_context("fork").Process(target=killed_after_one_batch)
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL
    [partial] = list(cache.glob("tokenized/*/*.tmp"))
    host, space = socket.gethostname(), pid_space()  # the writer: <host>.<space>-<pid>
    assert partial.name.startswith("tokens-") and f".arrow.{host}.{space}-{child.pid}." in partial.name
    assert partial.stat().st_size > 0 and not list(cache.rglob("manifest.json"))

    again = token_cache.tokenize_cached(dsd, tokenizer, TEXT, num_proc=1, cache_dir=cache)
    assert not list(cache.rglob("*.tmp"))
    assert _tokens(again) == _tokens(token_cache.tokenize_cached(dsd, tokenizer, TEXT, cache_dir=tmp_path / "clean"))


def test_only_temporary_files_of_writers_that_are_gone_are_stale(tmp_path):
    """Two live writers of one split keep their files (each holds its file's flock); a file of this host whose lock
    is free (its writer ended) goes at once; another host's file (its locks may not reach us) only after a day
    without writes."""
    import socket
    import subprocess
    import sys
    import time

    from lightning_seqmem.data.cache_dir import held_file, pid_space
    from lightning_seqmem.data.token_cache import STALE_AFTER_S, remove_stale_temporaries, stale_temporaries

    entry = tmp_path / "tokenized" / "k"
    entry.mkdir(parents=True)
    host = f"{socket.gethostname()}.{pid_space()}"  # this host and its process-id space
    names = {
        "ours": f"tokens-00000.arrow.{host}-{os.getpid()}.a1b2c3.tmp",
        "other live rank": f"tokens-00000.arrow.{host}-4242.d4e5f6.tmp",
        "dead": f"tokens-00000.arrow.{host}-4243.g7h8i9.tmp",
        "dead manifest": f"manifest.json.{host}-4243.j1k2l3.tmp",
        "other host, writing": "tokens-00001.arrow.node-7.cluster.0123456789ab-4242.m4n5o6.tmp",
        "other host, silent": "tokens-00002.arrow.node-7.cluster.0123456789ab-4242.p7q8r9.tmp",
    }
    for key, name in names.items():
        if key != "ours":
            (entry / name).write_bytes(b"partial")
    ours = held_file(entry, names["ours"], b"partial")
    hold = "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX)"
    live = subprocess.Popen(
        [sys.executable, "-c", hold + "; print(1, flush=True); time.sleep(60)", str(entry / names["other live rank"])],
        stdout=subprocess.PIPE,
    )
    try:
        assert live.stdout.readline().strip() == b"1"  # the other writer holds its file
        old = time.time() - STALE_AFTER_S - 60
        os.utime(entry / names["other host, silent"], (old, old))
        stale = {p.name for p in stale_temporaries(tmp_path)}
        assert stale == {names["dead"], names["dead manifest"], names["other host, silent"]}
        assert remove_stale_temporaries(tmp_path) == 3 * len(b"partial")
        assert sorted(p.name for p in entry.iterdir()) == sorted(
            names[k] for k in ("ours", "other live rank", "other host, writing")
        )
    finally:
        os.close(ours)
        live.kill()
        live.wait()


def test_a_damaged_entry_is_reported_and_tokenized_again(tmp_path, tokenizer, caplog):
    """A truncated Arrow file, then a manifest naming a missing file: one warning naming the entry each time (no
    Arrow traceback) and the same tokens again; the log line names the entry used."""
    import json
    import logging

    import pytest

    from lightning_seqmem.data.token_cache import tokenize_cached

    dsd = datasets.DatasetDict({"train": _data()})
    with caplog.at_level(logging.INFO):
        first = _tokens(tokenize_cached(dsd, tokenizer, TEXT, cache_dir=tmp_path))
    [entry] = list((tmp_path / "tokenized").iterdir())
    assert f"train: tokens written to the cache entry {entry}" in caplog.text

    [arrow] = list(entry.glob("tokens-*.arrow"))  # named after its writer: tokens-<writer>-00000.arrow
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    with pytest.warns(UserWarning, match=rf"Token cache entry {entry} is damaged \({arrow.name}: .*tokenizing again"):
        assert _tokens(tokenize_cached(dsd, tokenizer, TEXT, cache_dir=tmp_path)) == first

    manifest = entry / "manifest.json"
    meta = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**meta, "files": [*meta["files"], "tokens-gone-00001.arrow"]}))
    with pytest.warns(UserWarning, match=r"is damaged \(tokens-gone-00001.arrow: FileNotFoundError"):
        assert _tokens(tokenize_cached(dsd, tokenizer, TEXT, cache_dir=tmp_path)) == first
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert _tokens(tokenize_cached(dsd, tokenizer, TEXT, cache_dir=tmp_path)) == first
    assert f"train: tokens read from the cache entry {entry}" in caplog.text


def test_a_cache_dir_that_cannot_be_written_tokenizes_for_this_run(tmp_path, tokenizer):
    import pytest

    from lightning_seqmem.data.token_cache import tokenize_cached

    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache directory should be")
    dsd = datasets.DatasetDict({"train": _data()})
    with pytest.warns(
        UserWarning,
        match=rf"Cannot write the token cache under {blocked} \(.*\); tokenizing train into "
        r".* for this process only\. Set data\.cache_dir",
    ):
        tokens = _tokens(tokenize_cached(dsd, tokenizer, TEXT, cache_dir=blocked))
    assert tokens == _tokens(tokenize_cached(dsd, tokenizer, TEXT, cache_dir=tmp_path / "ok"))


def test_seqmem_cache_lists_entries_and_removes_the_old_ones(tmp_path, tokenizer):
    import subprocess
    import sys
    import time

    from lightning_seqmem.apps import cache as cache_app

    data = tmp_path / "pages.jsonl"
    data.write_text("".join(f'{{"text": "page {i} of the book"}}\n' for i in range(30)))
    root = tmp_path / "cache"
    for dataset in (str(data), _data()):
        dm = SeqMemDataModule(dataset=dataset, tokenizer=tokenizer, cache_dir=root, max_length=64)
        dm.prepare_data()
    entries = {e.dataset: e for e in cache_app.list_entries(root) if e.kind == "tokens"}
    made_by = " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]])[:200]  # in-memory data: named by its run
    assert set(entries) == {f"{data} (train)", f"in memory, 48 rows, from {made_by} (train)"}
    assert entries[f"{data} (train)"].rows == 30 and all(e.size > 0 for e in entries.values())

    listing = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "lightning_seqmem.apps.cache", "--cache-dir", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listing.returncode == 0, listing.stderr
    # It lists and removes files: it starts without torch (importing it was three quarters of its start-up).
    imported = {line.split("|")[-1].strip() for line in listing.stderr.splitlines() if line.startswith("import time")}
    assert "lightning_seqmem.data.value_checks" in imported and "torch" not in imported
    assert f"Cache {root}: 2 entries" in listing.stdout and "pages.jsonl (train)" in listing.stdout
    assert Path(tokenizer.name_or_path).name[:20] in listing.stdout

    month_ago = time.time() - 30 * 86400
    manifest = entries[f"{data} (train)"].path / "manifest.json"
    os.utime(manifest, (month_ago, month_ago))
    assert cache_app.main(["--cache-dir", str(root), "--older-than", "7d"]) == 0
    assert not manifest.parent.exists() and entries[f"in memory, 48 rows, from {made_by} (train)"].path.exists()
    assert (
        cache_app.main(["--cache-dir", str(root), "--all", "--dry-run"]) == 0 and len(cache_app.list_entries(root)) == 1
    )
    assert cache_app.main(["--cache-dir", str(root), "--all"]) == 0 and cache_app.list_entries(root) == []
    assert cache_app.parse_age("12h") == 12 * 3600 and cache_app.parse_age("2") == 2 * 86400


def test_seqmem_cache_finds_the_built_in_corpus_and_tokenizer_by_their_owners_names(monkeypatch, tmp_path):
    """The corpus and the tokenizer name their cache entries (data/corpus.py, data/tokenizer.py) under the one cache
    root; seqmem-cache lists them by those names."""
    from lightning_seqmem.apps.cache import list_entries
    from lightning_seqmem.data.corpus import corpus_path
    from lightning_seqmem.data.tokenizer import _default_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for entry in (corpus_path(), _default_path(4096)):
        assert entry.parent == default_cache_dir() == tmp_path / "lightning_seqmem"
        entry.mkdir(parents=True)
        (entry / "data").write_text("x")
    assert sorted(e.kind for e in list_entries()) == ["corpus", "tokenizer"]


def test_seqmem_cache_lists_a_value_check_marker_at_its_size(tmp_path):
    from lightning_seqmem.apps import cache as cache_app
    from lightning_seqmem.data.value_checks import CHECKED

    marker = tmp_path / CHECKED / ("ab" * 32)
    marker.parent.mkdir(parents=True)
    marker.write_text('{"largest": 4095, "column": "input_ids"}')
    (entry,) = cache_app.list_entries(tmp_path)
    assert entry.kind == "checked" and entry.size == marker.stat().st_size > 0
