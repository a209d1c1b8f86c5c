"""Tokenize once per node, into Arrow files under a cache directory of ours, keyed by what matters.

The key is a hash of the split's data (its ``datasets`` fingerprint), the tokenizer's *content* (its serialised
vocabulary and rules, not its name), the framing (BOS/EOS) and the columns, so changing any of them tokenizes
again. ``prepare_data`` (local rank 0) writes the Arrow files and then a small manifest; ``setup`` on every rank
finds the manifest and memory-maps the files. In-memory datasets, which ``datasets`` does not cache, get the same
treatment. The input text is streamed a slice at a time (``arrow_stream``), its pages dropped from the process as it
goes, rather than read through ``datasets.map``'s memory map, so tokenizing a file of any size keeps one slice of
text resident, not the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_seqmem.arrow_stream import Shard, iter_shard, plan_shards, system_memory_pool
from lightning_seqmem.data_source import document_frame, token_features, tokenize_function

_FORMAT = "tokens-v1"  # bump when the layout of the cached columns changes
SMALL_DATASET_ROWS = 20_000  # below this, extra processes cost more than they save
_TOKENS_PER_RECORD_BATCH = 1 << 20  # 4 MB of int32 ids per record batch of the cache files


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lightning_seqmem``, else ``~/.cache/lightning_seqmem``."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "lightning_seqmem"


def default_num_proc(rows: int) -> int:
    """1 for small datasets; else a fair share of the CPUs (at most 8: tokenizers are fast, disks are not)."""
    if rows < SMALL_DATASET_ROWS:
        return 1
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what the tokenizer does: its serialised backend (vocabulary, merges, normaliser, added tokens)
    and special tokens for fast tokenizers; ``datasets``' pickling hash for anything else."""
    h = hashlib.sha256(type(tokenizer).__qualname__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        h.update(backend.to_str().encode())
        h.update(repr(sorted((k, str(v)) for k, v in getattr(tokenizer, "special_tokens_map", {}).items())).encode())
    else:
        from datasets.fingerprint import Hasher

        h.update(Hasher.hash(tokenizer).encode())
    return h.hexdigest()


def _load(directory: Path):
    """The cached split, memory-mapped, or ``None`` when its manifest is missing (not written yet)."""
    manifest = directory / "manifest.json"
    if not manifest.exists():
        return None
    import datasets

    files = json.loads(manifest.read_text())["files"]
    parts = [datasets.Dataset.from_file(str(directory / f)) for f in files]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


@dataclass(frozen=True)
class _Job:
    """What a tokenization worker needs besides its rows (inherited by forked workers, pickled once otherwise)."""

    tokenizer: Any
    kind: str
    columns: list[str]
    text_column: str
    prompt_column: str
    completion_column: str
    add_bos: bool | None
    add_eos: bool
    split: str
    directory: str


_WORKER: tuple[Any, _Job] | None = None  # (dataset, job) of this worker process


def _init_worker(ds, job: _Job) -> None:
    global _WORKER
    _WORKER = (ds, job)


def _tokenize_shard(index: int, shard: Shard, ds=None, job: _Job | None = None, progress=None) -> tuple[str, int]:
    """Tokenize the rows of ``shard`` into ``tokens-<index>.arrow`` (an Arrow stream file ``datasets`` can
    memory-map); ``(file name, rows)``. The input is streamed a slice at a time (``arrow_stream``), never kept resident."""
    import pyarrow as pa

    if ds is None:
        ds, job = _WORKER
    fn = tokenize_function(job.tokenizer, job.kind, job.text_column, job.prompt_column, job.completion_column,
                           job.add_bos, job.add_eos)
    schema = token_features(job.kind).arrow_schema
    name = f"tokens-{index:05d}.arrow"
    path = os.path.join(job.directory, name)
    rows, pending, pending_tokens = 0, [], 0

    def flush(writer) -> None:
        # Few, large record batches: a reader maps the file and touches a page or more per batch header.
        writer.write_table(pa.Table.from_batches(pending, schema=schema).combine_chunks())
        pending.clear()

    # A temporary file of this writer's own: ranks that reach setup without prepare_data tokenize the same split
    # into the same directory at once, and each must be able to rename its complete file into place.
    handle, tmp = tempfile.mkstemp(prefix=f"{name}.", suffix=".tmp", dir=job.directory)
    os.close(handle)
    try:
        with system_memory_pool(), pa.OSFile(tmp, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            for first, batch in iter_shard(ds, shard, job.columns, batch_rows=256):
                columns = fn(batch.to_pydict(), range(first, first + batch.num_rows), job.split)
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
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # a failed pass leaves nothing behind
            os.unlink(tmp)
    return name, rows


def _tokenize_split(ds, job: _Job, procs: int) -> list[str]:
    """Tokenize ``ds`` with ``procs`` processes into Arrow files under ``job.directory``; their names, in row
    order. More shards than processes, so that uneven documents even out and progress moves."""
    from datasets.utils.tqdm import tqdm

    shards = plan_shards(ds, procs * 4 if procs > 1 else 1)
    if not shards:  # no rows: one empty file keeps the split's schema
        return [_tokenize_shard(0, Shard(0, 0, None), ds, job)[0]]
    with tqdm(total=len(ds), unit=" rows", desc=f"Tokenizing {job.split}") as progress:
        if procs == 1:
            return [_tokenize_shard(i, shard, ds, job, progress)[0] for i, shard in enumerate(shards)]
        import multiprocessing as mp

        context = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else None)
        with context.Pool(procs, initializer=_init_worker, initargs=(ds, job)) as pool:
            names = []
            for name, rows in pool.imap(_star_tokenize_shard, list(enumerate(shards))):
                names.append(name)
                progress.update(rows)
            return names


def _star_tokenize_shard(args: tuple[int, Shard]) -> tuple[str, int]:
    return _tokenize_shard(*args)


def tokenize_cached(dsd, tokenizer, kind: str = "text", text_column: str = "text", prompt_column: str = "prompt",
                    completion_column: str = "completion", add_bos: bool | None = None, add_eos: bool = True,
                    num_proc: int | None = None, cache_dir: str | os.PathLike | None = None):
    """``data_source.tokenize_dataset``, cached under ``cache_dir``: tokenize a split only the first time.

    Args:
        dsd: ``DatasetDict`` of text (or prompt/completion) splits.
        tokenizer, kind, text_column, prompt_column, completion_column, add_bos, add_eos: as in
            ``tokenize_dataset``.
        num_proc: tokenization processes; ``None``: ``default_num_proc``.
        cache_dir: root of the cache; ``None``: ``default_cache_dir()``.

    Returns:
        ``DatasetDict`` of memory-mapped token columns (``input_ids`` or ``prompt_ids``/``completion_ids``, and
        ``length``).
    """
    import datasets

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    frame = document_frame(tokenizer, add_bos, add_eos)
    columns = [text_column] if kind == "text" else [prompt_column, completion_column]
    common = json.dumps([_FORMAT, tokenizer_fingerprint(tokenizer), frame, kind, columns], default=str)
    out = {}
    for split, ds in dsd.items():
        key = hashlib.sha256((common + ds._fingerprint).encode()).hexdigest()[:32]
        directory = root / "tokenized" / key
        cached = _load(directory)
        if cached is None:
            directory.mkdir(parents=True, exist_ok=True)
            procs = num_proc if num_proc is not None else default_num_proc(len(ds))
            job = _Job(tokenizer, kind, columns, text_column, prompt_column, completion_column, add_bos, add_eos,
                       split, str(directory))
            files = _tokenize_split(ds, job, max(1, min(procs, len(ds))))
            tmp = directory / f"manifest.json.{os.getpid()}"
            tmp.write_text(json.dumps({"files": files, "split": split, "rows": len(ds)}))
            os.replace(tmp, directory / "manifest.json")  # atomic: a reader sees all of it or nothing
            cached = _load(directory)
        out[split] = cached
    return datasets.DatasetDict(out)


def check_values_once(ds, kind: str, split: str, vocab_size: int | None = None, cache_dir: Any = None) -> bool:
    """Check pre-tokenized token values (``data_source.check_token_values``) once per dataset version, then
    remember it by the data's fingerprint, so later runs and every rank skip it: the check reads every token, and
    on a memory-mapped billion-token file that touches every page (4 GB of resident memory) on each run.

    Returns:
        Whether the check ran (``False``: an earlier run checked this data against the same vocabulary).
    """
    from lightning_seqmem.data_source import check_token_values

    fingerprint = getattr(ds, "_fingerprint", None)
    if fingerprint is None or not getattr(ds, "cache_files", None):  # in memory: no stable version to remember
        check_token_values(ds, kind, split, vocab_size)
        return True
    key = hashlib.sha256(json.dumps([_FORMAT, "values-checked", fingerprint, kind, vocab_size]).encode()).hexdigest()
    marker = Path(cache_dir or default_cache_dir()) / "checked" / key
    if marker.exists():
        return False
    columns = ["input_ids", "labels"] if kind == "tokens" else ["prompt_ids", "completion_ids"]
    if not _streamed_values_ok([f["filename"] for f in ds.cache_files], columns, vocab_size):
        check_token_values(ds, kind, split, vocab_size)  # the exact check names the bad row; raises: no marker
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    return True


def _streamed_values_ok(files: list[str], columns: list[str], vocab_size: int | None) -> bool:
    """Whether every id in the Arrow files is an integer in ``[0, vocab_size)`` (labels may be -100).

    The files are read record batch by record batch, not memory-mapped, so resident memory stays one batch
    however large the data. ``False`` means "not shown clean" (a bad id, a non-integer column, or a file that is
    not an Arrow stream): the caller then runs the exact check, which names the row.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        for path in files:
            with system_memory_pool(), pa.OSFile(path) as source:
                for batch in pa.ipc.open_stream(source):
                    for column in columns:
                        if column not in batch.schema.names:
                            continue
                        values = pc.list_flatten(batch.column(column))
                        if not pa.types.is_integer(values.type):
                            return False
                        if column == "labels":
                            values = pc.filter(values, pc.not_equal(values, -100))
                        low, high = pc.min_max(values).values()
                        if low.is_valid and (low.as_py() < 0 or (vocab_size is not None and high.as_py() >= vocab_size)):
                            return False
    except (OSError, pa.ArrowInvalid):
        return False
    return True
