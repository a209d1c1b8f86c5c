"""What identifies a stream in a checkpoint: its shards and files, and the validation documents carved out of it.

A saved stream position is a shard and a row in it, so it means something only for the same shards: a changed file
list must be refused, not read from the wrong place. ``datasets`` keeps the files it reads in the stream's examples
iterable; a stream built from memory (``Dataset.to_iterable_dataset``) has no files, and is known by its shard count
and the digest of its first documents (the validation head). No Lightning import.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

__all__ = ["stream_files", "stream_identity"]


def stream_files(stream: Any) -> list[str] | None:
    """The files a ``datasets`` stream reads, in shard order (``None`` when it reads none)."""
    ex = getattr(stream, "_ex_iterable", None)
    while ex is not None:
        kwargs = getattr(ex, "kwargs", None) or {}
        ranges = kwargs.get("ranges")  # local line files cut into byte ranges (``data.line_ranges``)
        if isinstance(ranges, list) and ranges:
            return [f"{path}:{start}-{end}" for path, start, end in ranges]
        for key in ("base_files", "files"):
            files = kwargs.get(key)
            if isinstance(files, list) and files:
                flat = [f for group in files for f in (group if isinstance(group, (list, tuple)) else [group])]
                return [os.fspath(f) if not hasattr(f, "path") else str(f.path) for f in flat]
        ex = getattr(ex, "ex_iterable", None)
    return None


def stream_identity(stream: Any, leave_out: Any = None) -> dict[str, Any]:
    """The signature entries of a stream: ``stream_shards``, ``stream_files`` (where it reads files) and
    ``validation_documents_crc32`` (the documents carved out of its head, where they were)."""
    out: dict[str, Any] = {"stream_shards": getattr(stream, "num_shards", None)}
    files = stream_files(stream)
    if files is not None:
        out["stream_files"] = files
    if leave_out is not None:
        out["validation_documents_crc32"] = zlib.crc32(b"".join(sorted(leave_out.keys)))
    return out
