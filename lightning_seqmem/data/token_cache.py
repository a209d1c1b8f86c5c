"""Tokenize once per node, into Arrow files under a cache directory of ours, keyed by what matters.

The key is a hash of the split's data (its ``datasets`` fingerprint), the tokenizer's *content* (its serialised
vocabulary and rules, not its name), the framing (BOS/EOS) and the columns, so changing any of them tokenizes
again. ``prepare_data`` (local rank 0) writes the Arrow files and then a small manifest; ``setup`` on every rank
finds the manifest and memory-maps the files. In-memory datasets, which ``datasets`` does not cache, get the same
treatment. The input text is streamed a slice at a time (``arrow_stream``), its pages dropped from the process as it
goes, rather than read through ``datasets.map``'s memory map, so tokenizing a file of any size keeps one slice of
text resident, not the file.

Many writers, one entry (ranks, nodes on a shared disk): one writer at a time holds the entry's lock
(``cache_writers``), the others wait for its manifest. Should two write anyway (a lock broken as stale), each names
its files after itself (``tokens-<writer>-00000.arrow``) and the first manifest linked into place wins; the other
removes its files and reads the winner's. Crash leftovers: a writer holds a ``flock`` on each of its temporary files
(``tokens-….arrow.<host>.<space>-<pid>.<random>.tmp``), so a later run removes the files of writers that are gone
(a file of this host whose lock is free, or a file nobody has written to for a day) and never those of a live
writer, even one in another container with the same host name and process id. A damaged entry (a truncated Arrow
file, a manifest naming a missing file) and a cache directory that cannot be written are reported in one line and
tokenized again; an entry still unreadable right after it was written stops the run, naming it. ``seqmem-cache``
(``lightning_seqmem.apps.cache``) lists and removes entries.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
import sys
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lightning_seqmem.data.arrow_stream import Shard, iter_shard, plan_shards, system_memory_pool
from lightning_seqmem.data.backend import tokenizer_fingerprint
from lightning_seqmem.data.cache_dir import default_cache_dir, held_file
from lightning_seqmem.data.cache_writers import entry_writer, file_of_this_writer, writer_is_gone, writer_prefix
from lightning_seqmem.data.encode import document_frame
from lightning_seqmem.data.fork_workers import run_in_workers
from lightning_seqmem.messages import describe_source

_FORMAT = "tokens-v1"  # bump when the layout of the cached columns changes
SMALL_DATASET_ROWS = 20_000  # below this, extra processes cost more than they save
_TOKENS_PER_RECORD_BATCH = 1 << 20  # 4 MB of int32 ids per record batch of the cache files
# A temporary file untouched this long is a dead writer's, wherever it ran (a live one writes every 1 M tokens).
STALE_AFTER_S = 24 * 3600
# The cache's layout, read back by seqmem-cache (cache.py): <root>/TOKENIZED/<key>/MANIFEST (and value_checks' CHECKED)
TOKENIZED, MANIFEST = "tokenized", "manifest.json"


def default_num_proc(rows: int) -> int:
    """1 for small datasets; else a fair share of the CPUs (at most 8: tokenizers are fast, disks are not)."""
    if rows < SMALL_DATASET_ROWS:
        return 1
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def stale_temporaries(root: str | os.PathLike, max_age: float = STALE_AFTER_S) -> list[Path]:
    """The temporary files under ``root/tokenized`` whose writers are gone (see ``_writer_is_gone``)."""
    now = time.time()
    return [p for p in sorted(Path(root).glob("tokenized/*/*.tmp")) if writer_is_gone(p, now, max_age)]


def remove_stale_temporaries(root: str | os.PathLike, max_age: float = STALE_AFTER_S) -> int:
    """Remove the temporary files of writers that are gone (a crash mid-file); the bytes freed."""
    freed = 0
    for path in stale_temporaries(root, max_age):
        try:
            size = path.stat().st_size
            path.unlink()
            freed += size
        except OSError:  # removed by another rank meanwhile, or a read-only cache
            pass
    return freed


def _say(message: str, warn: bool = False) -> None:
    from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

    (rank_zero_warn if warn else rank_zero_info)(message)


def _say_on_every_rank(message: str) -> None:
    """Said by whichever process waits for another node's writer: a node that waits must not look hung."""
    print(message, file=sys.stderr, flush=True)


def _load(directory: Path, just_written: bool = False):
    """The cached split, memory-mapped, or ``None`` when its manifest is missing (not written yet) or the entry is
    damaged on disk (said in one line; the manifest is removed so the entry is written again).

    Raises:
        RuntimeError: ``just_written`` and the entry is damaged: something else writes into it, or the disk lost
            it; the message names the entry and how to go on.
    """
    manifest = directory / MANIFEST
    if not manifest.exists():
        return None
    import datasets
    import pyarrow as pa

    text = ""
    try:
        text = manifest.read_text()
        meta = json.loads(text)
        parts = []
        for name in meta["files"]:
            try:
                parts.append(datasets.Dataset.from_file(str(directory / name)))
            except (OSError, ValueError, pa.ArrowException) as err:
                raise ValueError(f"{name}: {type(err).__name__}: {str(err)[:200]}") from None
        ds = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
        if len(ds) != meta["rows"]:
            raise ValueError(f"{len(ds)} rows on disk, the manifest says {meta['rows']}")
    except (OSError, ValueError, KeyError, TypeError) as err:
        if just_written:
            raise RuntimeError(
                f"Token cache entry {directory} is damaged right after it was written ({err}): another program "
                "writes into it, or its disk lost the files. Remove that folder and run again, or set "
                "data.cache_dir (SeqMemDataModule(cache_dir=...)) to another directory."
            ) from None
        _say(f"[lightning_seqmem] Token cache entry {directory} is damaged ({err}); tokenizing again.", warn=True)
        with suppress(OSError):
            if manifest.read_text() == text:  # not a manifest another writer has put in its place meanwhile
                manifest.unlink()
        return None
    with suppress(OSError):  # a read-only cache still serves
        os.utime(manifest)  # the entry's last use, for seqmem-cache --older-than
    return ds


@dataclass(frozen=True)
class _Job:
    """What a tokenization worker needs besides its rows (inherited by forked workers, pickled once otherwise)."""

    tokenizer: Any
    kind: Any  # the data kind (``lightning_seqmem.kinds``): its map function and features
    columns: list[str]
    text_column: str
    split: str
    directory: str
    conversation: Any = None  # ``ConversationSettings`` of conversations
    writer: str = ""  # in the names of this writer's files: two writers of one entry never write the same file


def _tokenize_task(task: tuple[int, Shard], ds, job: _Job) -> tuple[str, int]:
    """One worker task: ``_tokenize_shard`` of ``(index, shard)``."""
    return _tokenize_shard(*task, ds, job)


def _tokenize_shard(index: int, shard: Shard, ds, job: _Job, progress=None) -> tuple[str, int]:
    """Tokenize the rows of ``shard`` into ``tokens-<index>.arrow`` (an Arrow stream file ``datasets`` can
    memory-map); ``(file name, rows)``. The input is streamed a slice at a time (``arrow_stream``), never kept
    resident."""
    import pyarrow as pa

    fn = job.kind.encoder(job.tokenizer, job.text_column, job.conversation)
    schema = job.kind.features().arrow_schema
    rows_of = _python_rows(ds, job.columns)
    name = f"tokens-{job.writer}-{index:05d}.arrow" if job.writer else f"tokens-{index:05d}.arrow"
    rows, pending, pending_tokens = 0, [], 0

    def flush(writer) -> None:
        # Few, large record batches: a reader maps the file and touches a page or more per batch header.
        writer.write_table(pa.Table.from_batches(pending, schema=schema).combine_chunks())
        pending.clear()

    with (
        file_of_this_writer(job.directory, name) as tmp,
        system_memory_pool(),
        pa.OSFile(tmp, "wb") as sink,
        pa.ipc.new_stream(sink, schema) as writer,
    ):
        for first, batch in iter_shard(ds, shard, job.columns, batch_rows=256):
            columns = fn(rows_of(batch), range(first, first + batch.num_rows), job.split)
            pending.append(pa.RecordBatch.from_pydict(columns, schema=schema))
            pending_tokens += sum(columns["length"])
            if pending_tokens >= _TOKENS_PER_RECORD_BATCH:
                flush(writer)
                pending_tokens = 0
            rows += batch.num_rows
            if progress is not None:
                progress.update(batch.num_rows)
        if pending or rows == 0:
            flush(writer)
    return name, rows


def _python_rows(ds, columns: list[str]):
    """``batch -> {column: values}`` as ``ds[i]`` gives them: the raw Arrow values, decoded where the column's
    feature needs it (a ``datasets.Json`` field, which ``datasets`` makes of a jsonl field whose values are of
    mixed types, is stored as JSON text: a string turn would otherwise reach the encoder with its quotes)."""
    import datasets
    from datasets.features.features import require_decoding

    features = datasets.Features({c: ds.features[c] for c in columns if c in ds.features})
    if not any(require_decoding(feature) for feature in features.values()):
        return lambda batch: batch.to_pydict()
    return lambda batch: features.decode_batch(batch.to_pydict())


def _tokenize_split(ds, job: _Job, procs: int) -> list[str]:
    """Tokenize ``ds`` with ``procs`` processes into Arrow files under ``job.directory``; their names, in row
    order. More shards than processes, so that uneven documents even out and progress moves."""
    from lightning_seqmem.data.progress_lines import RowProgress

    shards = plan_shards(ds, procs * 4 if procs > 1 else 1)
    if not shards:  # no rows: one empty file keeps the split's schema
        return [_tokenize_shard(0, Shard(0, 0, None), ds, job)[0]]
    with RowProgress(len(ds), f"Tokenizing {job.split}", _say) as progress:  # plain lines in a log file
        if procs == 1:
            return [_tokenize_shard(i, shard, ds, job, progress)[0] for i, shard in enumerate(shards)]
        names = [""] * len(shards)
        work = functools.partial(_tokenize_task, ds=ds, job=job)
        for index, (name, rows) in run_in_workers(work, list(enumerate(shards)), procs):
            names[index] = name
            progress.update(rows)
        return names


def tokenize_cached(
    dsd,
    tokenizer,
    kind: Any,
    text_column: str = "text",
    num_proc: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    source: Any = None,
    conversation: Any = None,
):
    """``encode.tokenize_dataset``, cached under ``cache_dir``: tokenize a split only the first time.

    Args:
        dsd, tokenizer, kind, text_column: as in ``encode.tokenize_dataset`` (``kind``: a ``kinds`` object, whose
            ``encoder`` tokenizes, ``features`` types the columns, ``source_columns`` and ``cache_key`` key the
            entry).
        num_proc: tokenization processes; ``None``: ``default_num_proc``.
        cache_dir: root of the cache; ``None``: ``default_cache_dir()``. When it cannot be written, the split is
            tokenized into a temporary directory for this process, with a warning.
        source: what the data is called (the DataModule's ``dataset`` argument), recorded in the entry's manifest
            for ``seqmem-cache``.
        conversation: the ``ConversationSettings`` of conversations (``text_column``: the turns).

    Returns:
        ``DatasetDict`` of memory-mapped token columns (``kind.features()``).
    """
    import datasets

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    remove_stale_temporaries(root)
    frame = document_frame(tokenizer)
    columns = kind.source_columns(text_column)
    chat = kind.cache_key(tokenizer, conversation)  # the template, train_on, ...
    common = json.dumps([_FORMAT, tokenizer_fingerprint(tokenizer), frame, kind.name, columns, *chat], default=str)
    out = {}
    for split, ds in dsd.items():
        key = hashlib.sha256((common + ds._fingerprint).encode()).hexdigest()[:32]
        directory = root / TOKENIZED / key
        cached, how = _load(directory), "read from"
        if cached is None:
            procs = num_proc if num_proc is not None else default_num_proc(len(ds))
            job = _Job(tokenizer, kind, columns, text_column, split, str(directory), conversation)
            about = {
                "split": split,
                "rows": len(ds),
                "dataset": describe_source(source, ds),
                "made_by": made_by(),  # names an in-memory dataset in seqmem-cache's listing
                "tokenizer": str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__),
            }
            blocked = _cannot_write(directory)
            if blocked is not None:  # tokenize for this process only, into a directory of its own
                directory = _scratch_root() / key
                directory.mkdir(parents=True, exist_ok=True)
                job = replace(job, directory=str(directory))
                _say(
                    f"[lightning_seqmem] Cannot write the token cache under {root} ({type(blocked).__name__}: "
                    f"{blocked.strerror or blocked}); tokenizing {split} into {directory} for this process only. "
                    "Set data.cache_dir (SeqMemDataModule(cache_dir=...)) to a writable directory to tokenize once.",
                    warn=True,
                )
            with entry_writer(directory, (directory / MANIFEST).exists, _say_on_every_rank) as must_write:
                if must_write:  # this process holds the entry's lock; the others wait for its manifest
                    _write_entry(ds, job, max(1, min(procs, len(ds))), about)
                cached, how = _load(directory, just_written=True), "written to" if must_write else "read from"
        _say(f"[lightning_seqmem] {split}: tokens {how} the cache entry {directory} (seqmem-cache lists them)")
        out[split] = cached
    return datasets.DatasetDict(out)


def made_by() -> str:
    """The command that wrote a cache entry, its script's name and arguments (``dpo.py --steps 5``): the one name
    data built in memory has."""
    argv = sys.argv if sys.argv and sys.argv[0] else ["python"]
    return " ".join([os.path.basename(argv[0]), *argv[1:]])[:200]


def _cannot_write(directory: Path) -> OSError | None:
    """Why files cannot be created in ``directory`` (made if missing), or ``None`` when they can."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(prefix=writer_prefix("probe"), suffix=".tmp", dir=directory)
        os.close(handle)
        os.unlink(probe)
    except OSError as err:
        return err
    return None


def _write_entry(ds, job: _Job, procs: int, about: dict[str, Any]) -> bool:
    """Tokenize ``ds`` into ``job.directory`` under names of this writer's own, then link its manifest into place
    (all of it or nothing). ``False`` when another writer's manifest got there first: ours and our files go, the
    entry stays theirs (same data, same tokens), never a mix of two writers' files."""
    directory = Path(job.directory)
    directory.mkdir(parents=True, exist_ok=True)  # the scratch directory's entry
    job = replace(job, writer=job.writer or secrets.token_hex(4))
    files = _tokenize_split(ds, job, procs)
    record = json.dumps({"files": files, **about, "created": time.time()}).encode()
    tmp = directory / f"{writer_prefix(MANIFEST)}{secrets.token_hex(6)}.tmp"
    handle = held_file(directory, tmp.name, record)
    try:
        try:
            os.link(tmp, directory / MANIFEST)  # fails where a manifest exists: the first writer's stays
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links: the last complete manifest wins, all of one writer
            os.replace(tmp, directory / MANIFEST)
        return True
    except FileExistsError:
        for name in files:
            with suppress(OSError):
                os.unlink(directory / name)
        return False
    finally:
        with suppress(OSError):
            os.unlink(tmp)
        os.close(handle)


_SCRATCH: list[tempfile.TemporaryDirectory] = []  # this process's stand-in for an unwritable cache


def _scratch_root() -> Path:
    if not _SCRATCH:
        _SCRATCH.append(tempfile.TemporaryDirectory(prefix="lightning_seqmem-tokens-"))
    return Path(_SCRATCH[0].name)
