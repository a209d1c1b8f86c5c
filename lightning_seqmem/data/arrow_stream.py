"""Read a ``datasets.Dataset`` in record batches without keeping its files resident, split into contiguous shards.

``datasets`` reads its Arrow files memory-mapped: every page a pass touches stays in the process's resident set
until the kernel needs it back, so one tokenization pass over a 7 GB text file shows as 7 GB of RSS (on each
worker that reads it). Here a file-backed dataset is mapped too (zero-copy), but the pages of each slice are
unmapped (``MADV_DONTNEED``) as soon as the caller has taken the slice: resident memory stays about one slice
however large the file. Shards are contiguous row ranges described by file offsets, so a worker seeks to its part
instead of reading the file up to it. Datasets that are in memory, or that a file read cannot reproduce (an
indices mapping from ``select`` / ``shuffle``, renamed or cast columns), are sliced from the ``datasets`` table
instead: same rows, same order.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# Table operations that ``datasets`` replays on a memory-mapped file and that do not change its rows or columns.
_HARMLESS_REPLAYS = {"replace_schema_metadata"}


@dataclass(frozen=True)
class FilePart:
    """Record batches ``[first, first + count)`` of one Arrow stream file; the first starts at byte ``offset``."""

    path: str
    offset: int
    count: int
    rows: int


@dataclass(frozen=True)
class Shard:
    """Rows ``[start, stop)`` of the dataset: read from ``parts`` (files, in order) or, when ``parts`` is
    ``None``, sliced from the dataset itself."""

    start: int
    stop: int
    parts: tuple[FilePart, ...] | None = None


def _file_blocks(ds) -> list[str] | None:
    """The Arrow files whose concatenation is ``ds``, in order, or ``None`` when a plain file read would not give
    the dataset's rows (in memory, an indices mapping, a slice, renamed/cast columns, side-by-side tables)."""
    from datasets.table import ConcatenationTable, MemoryMappedTable

    if getattr(ds, "_indices", None) is not None:
        return None
    table = ds.data
    rows = table.blocks if isinstance(table, ConcatenationTable) else [[table]]
    paths = []
    for row in rows:
        if len(row) != 1 or not isinstance(row[0], MemoryMappedTable):
            return None
        block = row[0]
        if any(name not in _HARMLESS_REPLAYS for name, _, _ in (block.replays or [])):
            return None
        paths.append(block.path)
    return paths


def _batch_offsets(path: str) -> tuple[Any, list[tuple[int, int]]] | None:
    """``(schema, [(byte offset, rows) per record batch])`` of an Arrow stream file, or ``None`` if it is not one
    (or holds dictionary batches). Scans message headers through a short-lived memory map: the bodies, which hold
    the data, are not touched."""
    import pyarrow as pa

    try:
        with pa.memory_map(path) as source:
            reader = pa.ipc.MessageReader.open_stream(source)
            schema = pa.ipc.read_schema(reader.read_next_message())
            out = []
            while True:
                offset = source.tell()
                try:
                    message = reader.read_next_message()
                except StopIteration:
                    break
                if message is None:
                    break
                if message.type != "record batch":
                    return None
                out.append((offset, pa.ipc.read_record_batch(message, schema).num_rows))
            return schema, out
    except (OSError, pa.ArrowInvalid, StopIteration):
        return None


def plan_shards(ds, shards: int) -> list[Shard]:
    """Split ``ds`` into at most ``shards`` contiguous, non-empty row ranges (record-batch aligned when read from
    files), in order."""
    n = len(ds)
    shards = max(1, min(shards, n))
    paths = _file_blocks(ds)
    scans = None if paths is None else [_batch_offsets(p) for p in paths]
    if scans is None or any(s is None for s in scans) or sum(r for s in scans for _, r in s[1]) != n:
        bounds = [n * k // shards for k in range(shards + 1)]
        return [Shard(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    batches = [(path, offset, rows) for path, (_, found) in zip(paths, scans) for offset, rows in found if rows]
    target = n / shards
    out, current, start, rows_in = [], [], 0, 0
    for path, offset, rows in batches:
        if current and current[-1].path == path:
            last = current[-1]
            current[-1] = FilePart(path, last.offset, last.count + 1, last.rows + rows)
        else:
            current.append(FilePart(path, offset, 1, rows))
        rows_in += rows
        if rows_in >= target * (len(out) + 1) - 1e-9 and len(out) < shards - 1:
            stop = rows_in
            out.append(Shard(start, stop, tuple(current)))
            current, start = [], stop
    if current:
        out.append(Shard(start, rows_in, tuple(current)))
    return out


def iter_shard(ds, shard: Shard, columns: list[str], batch_rows: int = 1000) -> Iterator[tuple[int, Any]]:
    """``(first row index, pyarrow RecordBatch of columns)`` for the rows of ``shard``, at most ``batch_rows`` a
    time. From files: each slice's pages are dropped from the mapping once the caller has it (see
    ``_mapped_batches``)."""
    row = shard.start
    if shard.parts is None:
        table = ds.select_columns(columns).with_format("arrow")
        for lo in range(shard.start, shard.stop, batch_rows):
            batch = table[lo : min(lo + batch_rows, shard.stop)]
            for rb in batch.to_batches():
                yield row, rb
                row += rb.num_rows
        return
    for part in shard.parts:
        for rb, drop in _mapped_batches(part, columns):
            for lo in range(0, rb.num_rows, batch_rows):
                piece = rb.slice(lo, batch_rows)
                yield row, piece
                row += piece.num_rows
                drop(piece)
    if row != shard.stop:
        raise RuntimeError(f"read {row - shard.start} rows for rows {shard.start}:{shard.stop}; the files changed")


def _mapped_batches(part: FilePart, columns: list[str]):
    """``(record batch, drop)`` for the batches of ``part``, zero-copy from a memory map of its file; ``drop(slice)``
    unmaps the pages holding the slice's strings, and each batch's pages go when the next is read. Pages unmapped
    this way stay in the page cache (a later touch maps them again), but leave the process's resident set, so a
    pass over a file of any size keeps about one slice resident instead of the file (or one record batch, had it
    been read into memory)."""
    import mmap

    import numpy as np
    import pyarrow as pa

    schema = _file_schema(part.path)
    with open(part.path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    page = mmap.PAGESIZE
    buffer = pa.py_buffer(mapped)
    base = buffer.address

    def unmap(lo: int, hi: int) -> None:
        lo = max(0, lo - lo % page)
        if hi > lo:
            mapped.madvise(mmap.MADV_DONTNEED, lo, min(hi, len(mapped)) - lo)

    def drop(piece) -> None:
        for column in piece.columns:
            wide = pa.types.is_large_string(column.type) or pa.types.is_large_binary(column.type)
            if not (wide or pa.types.is_string(column.type) or pa.types.is_binary(column.type)) or not len(column):
                continue
            _, offsets, data = column.buffers()
            if data is None:
                continue
            offsets = np.frombuffer(offsets, dtype=np.int64 if wide else np.int32)
            unmap(
                data.address - base + int(offsets[column.offset]),
                data.address - base + int(offsets[column.offset + len(column)]),
            )

    try:
        if hasattr(mmap, "MADV_SEQUENTIAL"):
            mapped.madvise(mmap.MADV_SEQUENTIAL)
        source = pa.BufferReader(buffer)
        source.seek(part.offset)
        reader = pa.ipc.MessageReader.open_stream(source)
        for _ in range(part.count):
            first = source.tell()
            rb = pa.ipc.read_record_batch(reader.read_next_message(), schema).select(columns)
            yield rb, drop
            unmap(first, source.tell())
    finally:
        del buffer
        try:
            mapped.close()
        except BufferError:  # the caller still holds the last slice: the map closes when that is freed
            pass


def _file_schema(path: str):
    import pyarrow as pa

    with pa.OSFile(path) as source:
        return pa.ipc.open_stream(source).schema


@contextmanager
def system_memory_pool():
    """Arrow allocations inside the block go to the system allocator, and what it holds free is handed back after.

    A pass over a large table allocates and frees a record batch per slice; Arrow's default pool (mimalloc or
    jemalloc) keeps the segments it has used, which showed as 30-40 MiB of resident memory after tokenizing 150 k
    documents. Allocations remember their pool, so switching back afterwards is safe.
    """
    import pyarrow as pa

    previous = pa.default_memory_pool()
    system = pa.system_memory_pool()
    pa.set_memory_pool(system)
    try:
        yield
    finally:
        pa.set_memory_pool(previous)
        system.release_unused()
