"""Many writers of one cache (ranks, nodes on a shared disk, containers that share a host name): the races made
deterministic with injected pauses; one entry tokenized once, never a mix of two writers' files, and a live
writer's files never taken for a dead one's."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import datasets
import pytest
from _forked_ranks import run_ranks

from lightning_seqmem.data import cache_dir, cache_writers, token_cache
from lightning_seqmem.kinds.text import Text

TEXT = Text()


def _file_dataset(tmp_path: Path, rows: int = 48) -> datasets.DatasetDict:
    """A split read from an Arrow file: the same fingerprint in every process that opens it."""
    path = tmp_path / "texts.arrow"
    if not path.exists():
        table = datasets.Dataset.from_dict({"text": [f"row {i} " + "gamma " * (i % 9) for i in range(rows)]})
        table.to_parquet(str(tmp_path / "texts.parquet"))
        datasets.Dataset.from_parquet(str(tmp_path / "texts.parquet"), cache_dir=str(tmp_path / "hf")).save_to_disk(
            str(tmp_path / "saved")
        )
        path.touch()
    return datasets.DatasetDict({"train": datasets.load_from_disk(str(tmp_path / "saved"))})


def _tokens(dsd) -> list[list[int]]:
    return [list(ids) for ids in dsd["train"]["input_ids"]]


def _wait_for(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return path.exists()


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


@pytest.mark.slow
def test_two_writers_with_different_num_proc_tokenize_one_entry_once(tmp_path, tokenizer):
    """Writer 0 (one process) and writer 1 (two) start on one entry; writer 1 starts once writer 0 is tokenizing
    (so writer 0 holds the entry: which rank wins the lock is otherwise a race), its tokenizing is held until
    writer 0 has put its manifest down, and writer 0 then waits for writer 1's files before reading the entry back. Writer 1
    must wait for the entry instead of writing files under writer 0's names (which damaged it, and writer 0 got
    ``None`` for its split)."""
    dsd, cache, clean = _file_dataset(tmp_path), tmp_path / "cache", None
    clean = _tokens(token_cache.tokenize_cached(dsd, tokenizer, TEXT, cache_dir=tmp_path / "clean"))
    wrote, second = tmp_path / "writer0-wrote", tmp_path / "writer1-wrote"
    started = tmp_path / "writer0-tokenizing"

    def writer(rank: int):
        tokenized = []
        real_split, real_load = token_cache._tokenize_split, token_cache._load

        def tokenize(ds, job, procs):
            tokenized.append(procs)
            if rank == 0:
                started.touch()
            if rank == 1:
                _wait_for(wrote, 30)  # held until writer 0's manifest is down
            names = real_split(ds, job, procs)
            if rank == 1:
                second.touch()
            return names

        def load(directory, *args, **kwargs):
            if rank == 0 and tokenized and not wrote.exists():
                wrote.touch()
                _wait_for(second, 2)  # writer 1 writes now, if nothing stops it
            return real_load(directory, *args, **kwargs)

        token_cache._tokenize_split, token_cache._load = tokenize, load
        if rank == 1:
            assert _wait_for(started, 60), "writer 0 never started tokenizing"
        out = token_cache.tokenize_cached(dsd, tokenizer, TEXT, num_proc=1 + rank, cache_dir=cache)
        return tokenized, _tokens(out)

    (tokenized0, tokens0), (tokenized1, tokens1) = run_ranks(writer, timeout=90)
    assert tokens0 == tokens1 == clean
    assert (tokenized0, tokenized1) == ([1], [])  # once, by the first; the other read its entry
    [entry] = (cache / "tokenized").iterdir()
    files = json.loads((entry / "manifest.json").read_text())["files"]
    assert sorted(p.name for p in entry.glob("tokens-*.arrow")) == sorted(files) and not list(entry.glob("*.tmp"))


def test_two_writers_past_the_lock_leave_one_writers_entry(tmp_path, tokenizer):
    """Should two write anyway (a lock broken as stale), each writes files of its own names: the first manifest
    down wins, the other's files go, and the entry is one writer's, whole."""
    dsd, directory = _file_dataset(tmp_path), tmp_path / "entry"
    ds = dsd["train"]
    about = {"split": "train", "rows": len(ds)}
    job = token_cache._Job(tokenizer, TEXT, ["text"], "text", "train", str(directory))
    real, results = token_cache._tokenize_split, {}

    def first_writes_its_files_then_the_other_writes_all(ds, job_, procs):
        names = real(ds, job_, procs)
        if "other" not in results:  # between our files and our manifest, the other writer does its whole pass
            token_cache._tokenize_split = real
            results["other"] = token_cache._write_entry(ds, job, 2, about)
        return names

    token_cache._tokenize_split = first_writes_its_files_then_the_other_writes_all
    try:
        results["first"] = token_cache._write_entry(ds, job, 1, about)
    finally:
        token_cache._tokenize_split = real
    assert results == {"other": True, "first": False}
    files = json.loads((directory / "manifest.json").read_text())["files"]
    assert sorted(p.name for p in directory.iterdir()) == sorted([*files, "manifest.json"])  # the other's files only
    clean = _tokens(token_cache.tokenize_cached(dsd, tokenizer, TEXT, cache_dir=tmp_path / "clean"))
    assert [list(ids) for ids in token_cache._load(directory)["input_ids"]] == clean


@pytest.mark.slow
def test_writers_of_two_containers_with_one_host_name_and_pid_keep_each_others_files(tmp_path, tokenizer):
    """Pods on one machine: the same host name and the same process id (faked here; each pod has its own process-id
    space, which a file's name cannot tell apart reliably). Writer 0 is paused inside its temporary file while
    writer 1 cleans the cache: the file is kept, because its writer still holds its lock."""
    dsd, cache = _file_dataset(tmp_path), tmp_path / "cache"
    paused, cleaned, pid = tmp_path / "paused", tmp_path / "cleaned", _dead_pid()

    def pod(rank: int):
        socket.gethostname = lambda: "pod"
        os.getpid = lambda: pid  # the same process id, a dead one's here: only the file's lock says it is live
        if rank == 1:
            assert _wait_for(paused, 60)
            freed = token_cache.remove_stale_temporaries(cache)
            cleaned.touch()
            return freed
        real = token_cache.iter_shard

        def pause_inside_the_file(*args, **kwargs):
            for item in real(*args, **kwargs):
                yield item
                if not paused.exists():
                    paused.touch()
                    _wait_for(cleaned, 30)

        token_cache.iter_shard = pause_inside_the_file
        return _tokens(token_cache.tokenize_cached(dsd, tokenizer, TEXT, num_proc=1, cache_dir=cache))

    tokens, freed = run_ranks(pod, timeout=90)
    assert freed == 0
    assert tokens == _tokens(token_cache.tokenize_cached(dsd, tokenizer, TEXT, cache_dir=tmp_path / "clean"))


def test_a_dead_writers_lock_is_taken_over_and_a_live_ones_waited_for(tmp_path, tokenizer, capsys):
    """A lock of this host whose holder's flock is free (it exited) is broken at once; a live holder's is waited on
    until its manifest appears, and nothing is tokenized twice."""
    dsd = _file_dataset(tmp_path)
    clean = _tokens(token_cache.tokenize_cached(dsd, tokenizer, TEXT, cache_dir=tmp_path / "first"))
    [entry] = (tmp_path / "first" / "tokenized").iterdir()
    key = entry.name

    dead = tmp_path / "dead" / "tokenized" / key
    dead.mkdir(parents=True)
    holder = {"host": socket.gethostname(), "space": cache_dir.pid_space(), "pid": _dead_pid(), "since": 0}
    (dead / cache_writers.LOCK).write_text(json.dumps(holder))
    started = time.monotonic()
    assert _tokens(token_cache.tokenize_cached(dsd, tokenizer, TEXT, cache_dir=tmp_path / "dead")) == clean
    assert time.monotonic() - started < cache_writers.STALE_LOCK_S and not (dead / cache_writers.LOCK).exists()

    live = tmp_path / "live" / "tokenized" / key
    live.mkdir(parents=True)
    holder = {"host": socket.gethostname(), "space": cache_dir.pid_space(), "pid": os.getpid(), "since": 0}
    held = cache_dir.held_file(live, cache_writers.LOCK, json.dumps(holder).encode(), create_only=True)

    def finish_as_the_holder():  # the live holder puts its entry down a moment later, then lets go
        time.sleep(0.5)
        for path in entry.iterdir():
            (live / path.name).write_bytes(path.read_bytes())
        (live / cache_writers.LOCK).unlink()
        os.close(held)

    holder_thread = threading.Thread(target=finish_as_the_holder)
    holder_thread.start()
    real, tokenized = token_cache._tokenize_split, []
    token_cache._tokenize_split = lambda *a: tokenized.append(a) or real(*a)
    try:
        assert _tokens(token_cache.tokenize_cached(dsd, tokenizer, TEXT, cache_dir=tmp_path / "live")) == clean
    finally:
        token_cache._tokenize_split = real
        holder_thread.join()
    assert tokenized == []
    waited = capsys.readouterr().err  # said by the process that waits, whatever its rank
    assert (
        f"Token cache entry {live} is being written by process {os.getpid()} on host {socket.gethostname()}" in waited
    )


def test_two_builders_of_the_corpus_in_one_process_each_fill_their_own_folder(tmp_path, monkeypatch):
    """Two builders with the same host name and process id (threads here; containers on one machine, or a
    test's workers) build the built-in corpus at once: each writes a folder of its own, one is kept."""
    from lightning_seqmem.data import corpus

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    docs = [f"document {i}: " + "delta " * (i % 13) for i in range(200)]
    monkeypatch.setattr(corpus, "build_documents", lambda: list(docs))
    both_inside = threading.Barrier(2, timeout=20)
    real = corpus.corpus_fingerprint

    def fingerprint_once_both_have_written(found):
        both_inside.wait()  # both builders have saved their splits and not yet finished
        return real(found)

    monkeypatch.setattr(corpus, "corpus_fingerprint", fingerprint_once_both_have_written)
    results, errors = [], []

    def build():
        try:
            built = corpus.load_builtin_corpus(verbose=False)
            results.append(sorted([*built["train"]["text"], *built["validation"]["text"]]))
        except Exception as err:  # reported below with the other builder's result
            errors.append(repr(err))

    builders = [threading.Thread(target=build) for _ in range(2)]
    for b in builders:
        b.start()
    for b in builders:
        b.join(60)
    assert errors == [] and results == [sorted(docs)] * 2
    assert [p.name for p in tmp_path.joinpath("lightning_seqmem").iterdir()] == [corpus.corpus_path().name]


def test_an_entry_damaged_right_after_its_writer_finished_stops_the_run_naming_it(tmp_path, tokenizer):
    """Something else writes into the entry between our files and our reading them back (another program, a disk
    that lost them): the run stops with the entry's name and the ways out, never a split of ``None``."""
    dsd, cache = _file_dataset(tmp_path), tmp_path / "cache"
    real = token_cache._write_entry

    def written_then_cut_short(ds, job, procs, about):
        won = real(ds, job, procs, about)
        for path in Path(job.directory).glob("tokens-*.arrow"):
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return won

    token_cache._write_entry = written_then_cut_short
    try:
        with pytest.raises(RuntimeError, match=r"Token cache entry .*/tokenized/\w+ is damaged right after it was"):
            token_cache.tokenize_cached(dsd, tokenizer, TEXT, cache_dir=cache)
    finally:
        token_cache._write_entry = real
    assert not list(cache.rglob(cache_writers.LOCK))  # the lock went with the failed writer
