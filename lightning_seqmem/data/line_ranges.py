"""Local JSON Lines and text files streamed as byte ranges: shards a reader can go back to without reading the file
from its start.

``datasets`` streams a file as one shard and, on resume, parses it again up to the row it had reached: a late cut
in a big file costs a late read. Cut at line boundaries into ranges of about ``chunk_bytes``, each file becomes many
shards (so one big file is also dealt to loader workers and ranks), and a resumed reader opens its range at its
byte offset and reads at most one range again. The ranges are still a ``datasets.IterableDataset``
(``from_generator``), so sharding, splitting by node and per-shard state are ``datasets``'. No Lightning import.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

CHUNK_BYTES = 4 << 20
"""Bytes per range: a resumed reader reads at most this much again (tens of milliseconds of JSON)."""

MARK = "lightning_seqmem line ranges"
"""Set as the stream's ``info.description``: its shards go back to a row by reading at most one range."""

__all__ = ["CHUNK_BYTES", "MARK", "line_ranges", "line_range_stream", "read_ranges"]


def line_ranges(files: Sequence[str], chunk_bytes: int | None = None) -> list[tuple[str, int, int]]:
    """``(path, start, end)`` byte ranges of about ``chunk_bytes`` (default :data:`CHUNK_BYTES`) covering
    ``files``, each starting on a line."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    out = []
    for path in files:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            start = 0
            while start < size:
                end = min(size, start + chunk_bytes)
                if end < size:
                    f.seek(end)
                    end += len(f.readline())  # to the end of the line the cut fell in
                out.append((os.fspath(path), start, end))
                start = end
    return out


def read_ranges(ranges: list[tuple[str, int, int]], parse: str) -> Iterator[dict[str, Any]]:
    """The rows of each range: a JSON object per non-blank line (``parse="json"``), or ``{"text": line}`` for every
    line (``"text"``, as ``datasets``' text builder reads them). A bad line is named by its file and byte offset."""
    for path, start, end in ranges:
        with open(path, "rb") as f:
            f.seek(start)
            at = start
            while at < end:
                line = f.readline()
                if not line:
                    break
                offset, at = at, at + len(line)
                text = line.rstrip(b"\r\n").decode("utf-8")
                if parse == "text":
                    yield {"text": text}
                elif text.strip():
                    try:
                        yield json.loads(text)
                    except ValueError as err:
                        raise ValueError(
                            f"{path}: the line at byte {offset} is not JSON ({err}). Fix or remove that line."
                        ) from None


def line_range_stream(files: Sequence[str], parse: str, features: Any = None, chunk_bytes: int | None = None):
    """``files`` as a ``datasets.IterableDataset`` of byte-range shards (:func:`line_ranges`)."""
    import datasets

    stream = datasets.IterableDataset.from_generator(
        read_ranges, features=features, gen_kwargs={"ranges": line_ranges(files, chunk_bytes), "parse": parse}
    )
    stream.info.description = MARK
    return stream
