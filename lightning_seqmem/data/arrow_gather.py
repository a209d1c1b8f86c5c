"""Bulk gather of token segments by Arrow: many ``(chunk, start, length)`` segments of numpy token chunks copied
back to back in one C++ call, through a ``binary_view`` array over the same bytes (``tokens.TokenView.gather``
uses it above :data:`ARROW_GATHER_MIN_SEGMENTS` segments)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

ARROW_GATHER_MIN_SEGMENTS = 256  # below this, numpy views + concatenate cost less than building Arrow views
_WINDOW = 1 << 30  # bytes: Arrow binary views address their buffers with int32 offsets


def gather_arrow(
    chunks: Sequence[np.ndarray], chunk: np.ndarray | None, local: np.ndarray, length: np.ndarray
) -> np.ndarray | None:
    """Segments ``chunks[chunk[i]][local[i] : local[i] + length[i]]`` back to back, copied by Arrow in C++.

    Why: one numpy view per segment plus ``np.concatenate`` costs about a microsecond of Python per segment
    (0.15 s for 200 k documents); the ``binary_view_of`` array over the same bytes cast to ``large_binary`` does
    every copy in one C++ call, GIL released, into Arrow's memory pool (0.04 s). The result is a read-only view
    of that buffer.

    Args:
        chunks: flat token arrays, one dtype.
        chunk: ``[segments]`` chunk of each segment, or ``None`` when there is one chunk.
        local, length: ``[segments]`` first token and token count of each segment inside its chunk.

    Returns:
        ``[sum(length)]`` tokens, or ``None`` where this path does not apply (a segment over 1 GiB).
    """
    import pyarrow as pa

    dtype = chunks[0].dtype
    total = int(length.sum())
    if total == 0:
        return np.zeros(0, dtype)
    views = binary_view_of(chunks, chunk, local, length)
    if views is None:
        return None
    data = views.cast(pa.large_binary()).buffers()[2]
    return np.frombuffer(data, dtype=dtype, count=total)


def binary_view_of(chunks: Sequence[np.ndarray], chunk: np.ndarray | None, local: np.ndarray, length: np.ndarray):
    """A ``pyarrow`` ``binary_view`` array whose value ``i`` is the bytes of segment ``i`` (see ``gather_arrow``),
    over the chunks' memory (no copy), or ``None`` when a segment is over 1 GiB, the chunks' dtypes differ or the
    machine is big-endian (the views are written little-endian).

    One 16-byte view per segment: its size, its first 4 bytes (or all of it when it has at most 12 bytes, kept
    inline), then which buffer and where.
    """
    import pyarrow as pa

    chunks = [np.ascontiguousarray(c) for c in chunks]
    dtype = chunks[0].dtype
    itemsize = dtype.itemsize
    nbytes = length * itemsize
    if (
        sys.byteorder != "little"
        or (nbytes.size and int(nbytes.max()) > _WINDOW)
        or any(c.dtype != dtype for c in chunks)
    ):
        return None
    byte_pos = local * itemsize
    # Buffer k of a chunk is its bytes from k GiB to k + 2 GiB: a segment of at most 1 GiB that starts in
    # [k, k + 1) GiB lies inside it, at an offset below 2**31. Most chunks are one window.
    windows = [max(1, -(-c.nbytes // _WINDOW)) for c in chunks]
    buffers = []
    for c, n in zip(chunks, windows):
        whole = pa.py_buffer(c.view(np.uint8))
        buffers += (
            [whole]
            if n == 1
            else [whole.slice(k * _WINDOW, min(c.nbytes - k * _WINDOW, 2 * _WINDOW)) for k in range(n)]
        )
    views = np.empty((len(length), 4), dtype=np.int32)  # Arrow's BinaryView layout, little-endian
    views[:, 0] = nbytes
    if len(buffers) == len(chunks):  # one window per chunk: buffer = chunk, offset = byte position
        views[:, 2] = 0 if chunk is None else chunk
        views[:, 3] = byte_pos
    else:
        first_window = np.concatenate([[0], np.cumsum(windows)[:-1]])
        views[:, 2] = (0 if chunk is None else first_window[chunk]) + byte_pos // _WINDOW
        views[:, 3] = byte_pos % _WINDOW
    _fill_view_bytes(views, chunks, chunk, byte_pos, nbytes)
    return pa.Array.from_buffers(pa.binary_view(), len(length), [None, pa.py_buffer(views)] + buffers)


def _fill_view_bytes(
    views: np.ndarray, chunks: Sequence[np.ndarray], chunk: np.ndarray | None, byte_pos: np.ndarray, nbytes: np.ndarray
) -> None:
    """Bytes 4..16 of each view: a segment's first 4 bytes (its prefix), or all of it, zero-padded, when it has
    at most 12 bytes (Arrow keeps such values inline)."""
    if chunk is None:
        groups = [(None, chunks[0])]
    else:  # segments grouped by chunk: one sort, then one slice per chunk that has segments
        order = np.argsort(chunk.astype(np.uint32), kind="stable")
        bounds = np.concatenate([[0], np.cumsum(np.bincount(chunk, minlength=len(chunks)))]).tolist()
        groups = [
            (order[bounds[c] : bounds[c + 1]], chunks[c]) for c in range(len(chunks)) if bounds[c + 1] > bounds[c]
        ]
    small = nbytes <= 12
    for sel, data in groups:
        data_bytes = data.view(np.uint8)
        pos, size = (byte_pos, nbytes) if sel is None else (byte_pos[sel], nbytes[sel])
        if not data_bytes.size:  # only empty segments here: inline, all zero
            views[slice(None) if sel is None else sel, 1:] = 0
            continue
        if data.dtype.itemsize % 4 == 0:  # aligned: each prefix is one int32 (inline ones are rewritten below)
            words = data_bytes.view(np.int32)
            prefix = words[np.minimum(pos >> 2, len(words) - 1)]
        else:
            prefix = _bytes_at(data_bytes, pos, size, 4).view(np.int32)[:, 0]
        views[slice(None) if sel is None else sel, 1] = prefix
        little = np.flatnonzero(small) if sel is None else sel[small[sel]]
        if little.size:
            views.view(np.uint8)[little, 4:] = _bytes_at(data_bytes, byte_pos[little], nbytes[little], 12)


def _bytes_at(data: np.ndarray, pos: np.ndarray, nbytes: np.ndarray, width: int) -> np.ndarray:
    """``[n, width]`` bytes ``data[pos : pos + width]``, zero past each ``nbytes``."""
    if not len(data):
        return np.zeros((len(pos), width), np.uint8)
    index = np.minimum(pos[:, None] + np.arange(width), len(data) - 1)
    return np.where(np.arange(width) < nbytes[:, None], data[index], 0).astype(np.uint8)
