"""Token sources: documents as zero-copy numpy views of Arrow list columns, gathered on demand.

A ``datasets`` token column is a ``ChunkedArray`` of ``list<int>`` chunks, memory-mapped from disk. ``TokenView``
keeps numpy views of each chunk's values and, per document, a start and a length (16 bytes per document), so
planning (pad / truncate / pack) works on the lengths and rows are gathered only when served: resident memory
grows with the number of documents, not with the number of tokens. A dataset's indices mapping (after
``select``, ``shuffle`` or ``train_test_split``) is applied to the starts, never to the tokens.

``ConcatView`` (a prompt then its completion) and ``ConstantView`` (-100 labels on a prompt) give the same
interface without copying tokens. Every source gathers segments ``(doc, start, length)`` in bulk.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from lightning_seqmem.data.arrow_gather import ARROW_GATHER_MIN_SEGMENTS, gather_arrow


@runtime_checkable
class TokenSource(Protocol):
    """Documents of tokens: ``lengths`` ``[docs]`` and bulk gathering of segments."""

    lengths: np.ndarray

    def pieces(self, doc: np.ndarray, start: np.ndarray, length: np.ndarray) -> list[np.ndarray]:
        """One array per segment: tokens ``start : start + length`` of document ``doc``."""
        ...


class _SourceMixin:
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)

    def gather(self, doc: np.ndarray, start: np.ndarray | None = None, length: np.ndarray | None = None) -> np.ndarray:
        """Segments back to back: ``[sum(length)]`` (whole documents when ``start``/``length`` are omitted)."""
        doc = np.asarray(doc, dtype=np.int64)
        start = np.zeros(doc.size, np.int64) if start is None else np.asarray(start, dtype=np.int64)
        length = self.lengths[doc] if length is None else np.asarray(length, dtype=np.int64)
        return self._gather(doc, start, length)

    def _gather(self, doc: np.ndarray, start: np.ndarray, length: np.ndarray) -> np.ndarray:
        """``gather`` one numpy view per segment, concatenated (any source; cheap for a few segments)."""
        pieces = self.pieces(doc, start, length)
        if not pieces:
            return np.zeros(0, dtype=self.dtype)
        return pieces[0].copy() if len(pieces) == 1 else np.concatenate(pieces)

    def row(self, i: int) -> np.ndarray:
        """Document ``i`` as a 1-D array (a view where the source allows)."""
        i = int(i)
        pieces = self.pieces(np.asarray([i]), np.zeros(1, np.int64), self.lengths[i : i + 1])
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def select(self, docs: np.ndarray):
        """A source over documents ``docs`` (no tokens copied)."""
        raise NotImplementedError


class TokenView(_SourceMixin):
    """Documents stored in flat numpy chunks: document ``i`` is ``tokens[starts[i] : starts[i] + lengths[i]]``.

    Args:
        chunks: flat token arrays (views of Arrow buffers); ``starts`` address them as if concatenated.
        starts: ``[docs]`` position of each document in the concatenated chunks.
        lengths: ``[docs]`` tokens per document.
    """

    # Gathers of at most this many segments (serving rows) read the files behind memory-mapped chunks with
    # ``pread`` (``file_reads``); larger ones (a bulk pass over the data) read through the map.
    PREAD_MAX_SEGMENTS = 4096

    def __init__(self, chunks: Sequence[np.ndarray], starts: np.ndarray, lengths: np.ndarray) -> None:
        self.chunks = [np.asarray(c) for c in chunks] or [np.zeros(0, np.int64)]
        self.chunk_base = np.concatenate([[0], np.cumsum([len(c) for c in self.chunks])]).astype(np.int64)
        self.starts = np.asarray(starts, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.dtype = self.chunks[0].dtype
        self._files: dict[str, Any] = {}  # the chunks' SegmentReader, found on first use; shared by select()

    def _reader(self):
        if "reader" not in self._files:
            from lightning_seqmem.data.file_reads import SegmentReader, file_locations

            locations = file_locations(self.chunks)
            self._files["reader"] = SegmentReader(locations, self.dtype.itemsize) if any(locations) else None
        return self._files["reader"]

    def row(self, i: int) -> np.ndarray:
        if self._reader() is None:
            return super().row(i)
        return self.gather(np.asarray([int(i)]))

    @classmethod
    def from_flat(cls, flat: np.ndarray, offsets: np.ndarray) -> TokenView:
        offsets = np.asarray(offsets, dtype=np.int64)
        return cls([np.asarray(flat)], offsets[:-1], np.diff(offsets))

    def select(self, docs: np.ndarray) -> TokenView:
        docs = np.asarray(docs, dtype=np.int64)
        view = TokenView.__new__(TokenView)
        view.chunks, view.chunk_base, view.dtype, view._files = self.chunks, self.chunk_base, self.dtype, self._files
        view.starts, view.lengths = self.starts[docs], self.lengths[docs]
        return view

    def trim(self, offset: np.ndarray, length: np.ndarray) -> TokenView:
        """Every document cut to ``[offset, offset + length)`` (per-document arrays), without copying tokens."""
        view = self.select(np.arange(len(self.lengths)))
        view.starts = self.starts + np.asarray(offset, dtype=np.int64)
        view.lengths = np.asarray(length, dtype=np.int64)
        return view

    def _locate(self, doc: np.ndarray, start: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """``(chunk, position in it)`` of each segment's first token (``chunk`` is ``None`` with one chunk)."""
        pos = self.starts[doc] + start
        if len(self.chunks) == 1:
            return None, pos
        # A document never crosses a chunk, so its segment lives in the chunk that holds its first token (an empty
        # segment at the very end: in the last chunk).
        chunk = np.minimum(np.searchsorted(self.chunk_base, pos, side="right") - 1, len(self.chunks) - 1)
        return chunk, pos - self.chunk_base[chunk]

    def _gather(self, doc: np.ndarray, start: np.ndarray, length: np.ndarray) -> np.ndarray:
        if 0 < doc.size <= self.PREAD_MAX_SEGMENTS and self._reader() is not None:
            chunk, local = self._locate(doc, start)
            chunk = np.zeros(doc.size, np.int64) if chunk is None else chunk
            if self._reader().covers(chunk):
                out = np.empty(int(length.sum()), dtype=self.dtype)
                return self._reader().read(out, chunk.tolist(), local.tolist(), length.tolist())
        if doc.size >= ARROW_GATHER_MIN_SEGMENTS:
            chunk, local = self._locate(doc, start)
            out = gather_arrow(self.chunks, chunk, local, length)
            if out is not None:
                return out
        return super()._gather(doc, start, length)

    def pieces(self, doc: np.ndarray, start: np.ndarray, length: np.ndarray) -> list[np.ndarray]:
        chunk, local = self._locate(doc, start)
        if chunk is None:
            flat = self.chunks[0]
            return [flat[a : a + n] for a, n in zip(local.tolist(), np.asarray(length).tolist())]
        chunks = self.chunks
        return [chunks[c][a : a + n] for c, a, n in zip(chunk.tolist(), local.tolist(), np.asarray(length).tolist())]

    @property
    def is_contiguous(self) -> bool:
        """One chunk holding the documents back to back in order (then ``flat`` is the whole token stream)."""
        return (
            len(self.chunks) == 1
            and len(self.starts) > 0
            and int(self.starts[0]) == 0
            and int(self.lengths.sum()) == len(self.chunks[0])
            and bool(np.all(self.starts[1:] == np.cumsum(self.lengths)[:-1]))
        )


class ConcatView(_SourceMixin):
    """Document ``i`` is ``first[i]`` followed by ``second[i]`` (a prompt and its completion), never copied."""

    def __init__(self, first: _SourceMixin, second: _SourceMixin) -> None:
        self.first, self.second = first, second
        self.lengths = first.lengths + second.lengths
        self.dtype = np.result_type(first.dtype, second.dtype)

    def select(self, docs: np.ndarray) -> ConcatView:
        return ConcatView(self.first.select(docs), self.second.select(docs))

    def _split(self, doc: np.ndarray, start: np.ndarray, length: np.ndarray):
        """Each segment's part in ``first`` and in ``second``: ``(a_start, a_len, b_start, b_len)``."""
        split = self.first.lengths[doc]
        end = start + length
        a_start, b_start = np.minimum(start, split), np.maximum(start - split, 0)
        return a_start, np.minimum(end, split) - a_start, b_start, np.maximum(end - split, 0) - b_start

    def pieces(self, doc: np.ndarray, start: np.ndarray, length: np.ndarray) -> list[np.ndarray]:
        a_start, a_len, b_start, b_len = self._split(doc, start, length)
        a = self.first.pieces(doc, a_start, a_len)
        b = self.second.pieces(doc, b_start, b_len)
        return [p for pair in zip(a, b) for p in pair]

    def _gather(self, doc: np.ndarray, start: np.ndarray, length: np.ndarray) -> np.ndarray:
        if doc.size == 0 or doc.size > TokenView.PREAD_MAX_SEGMENTS:
            return super()._gather(doc, start, length)
        # Serving rows: each side gathers its own parts in one call (``pread`` for file-backed views), then the
        # parts are interleaved by index (at most a few thousand segments, so the index arrays stay small).
        a_start, a_len, b_start, b_len = self._split(doc, start, length)
        a = self.first.gather(doc, a_start, a_len)
        b = self.second.gather(doc, b_start, b_len)
        out = np.empty(a.size + b.size, dtype=self.dtype)
        seg = np.concatenate([[0], np.cumsum(length)[:-1]]).astype(np.int64)
        a_cum = np.concatenate([[0], np.cumsum(a_len)[:-1]]).astype(np.int64)
        b_cum = np.concatenate([[0], np.cumsum(b_len)[:-1]]).astype(np.int64)
        out[np.repeat(seg - a_cum, a_len) + np.arange(a.size)] = a
        out[np.repeat(seg + a_len - b_cum, b_len) + np.arange(b.size)] = b
        return out

    def row(self, i: int) -> np.ndarray:
        return self.gather(np.asarray([int(i)]))


class ConstantView(_SourceMixin):
    """Documents of one repeated value (``-100`` labels on prompts) of the given lengths."""

    def __init__(self, value: int, lengths: np.ndarray, dtype: Any = np.int64) -> None:
        self.value, self.lengths, self.dtype = value, np.asarray(lengths, dtype=np.int64), np.dtype(dtype)

    def select(self, docs: np.ndarray) -> ConstantView:
        return ConstantView(self.value, self.lengths[np.asarray(docs, dtype=np.int64)], self.dtype)

    def pieces(self, doc: np.ndarray, start: np.ndarray, length: np.ndarray) -> list[np.ndarray]:
        longest = int(np.max(length, initial=0))
        block = np.full(longest, self.value, dtype=self.dtype)
        return [block[:n] for n in np.asarray(length).tolist()]


# ------------------------------------------------------------------------------------------------ from Arrow
def _list_chunk(chunk) -> tuple[np.ndarray, np.ndarray]:
    """``(values, offsets)`` of one Arrow ``ListArray``/``LargeListArray`` chunk, both zero-copy where possible."""
    import pyarrow as pa

    if not (pa.types.is_list(chunk.type) or pa.types.is_large_list(chunk.type)):
        raise TypeError(f"expected a list<int> column, got Arrow type {chunk.type}.")
    if chunk.null_count:
        raise ValueError(f"the token column holds {chunk.null_count} null rows; drop or fill them first.")
    values = chunk.values  # the whole child array; ``offsets`` below already point into it
    if values.null_count:
        raise ValueError("the token column holds null tokens; drop or fill them first.")
    if not (pa.types.is_integer(values.type)):
        raise ValueError(
            f"token values must be integers, got Arrow type {values.type}; cast the column "
            "(dataset.cast_column(...)) or tokenize the text again."
        )
    return values.to_numpy(zero_copy_only=False), chunk.offsets.to_numpy(zero_copy_only=False).astype(np.int64)


def view_of_arrow(column, indices: np.ndarray | None = None) -> TokenView:
    """A ``TokenView`` of an Arrow list column (``Array`` or ``ChunkedArray``), optionally through row indices."""
    import pyarrow as pa

    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    flats, starts, lengths, base = [], [], [], 0
    for chunk in chunks:
        values, offsets = _list_chunk(chunk)
        flats.append(values)
        starts.append(offsets[:-1] + base)
        lengths.append(np.diff(offsets))
        base += len(values)
    starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)
    lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    view = TokenView(flats, starts, lengths)
    return view if indices is None else view.select(indices)


def dataset_indices(ds) -> np.ndarray | None:
    """The row indices a ``datasets.Dataset`` maps through (after ``select``/``shuffle``), or ``None``."""
    mapping = getattr(ds, "_indices", None)
    if mapping is None:
        return None
    return mapping.column(0).to_numpy().astype(np.int64)


def view_of_dataset(ds, column: str = "input_ids") -> TokenView:
    """A ``TokenView`` of one list column of a ``datasets.Dataset``: the memory-mapped Arrow data, no copy."""
    if column not in ds.column_names:
        raise ValueError(f"the dataset has no {column!r} column (it has {sorted(ds.column_names)}).")
    return view_of_arrow(ds.data.column(column), dataset_indices(ds))


def as_token_source(sequences: Any, column: str = "input_ids") -> _SourceMixin:
    """Any accepted form of documents to a token source, without building Python lists.

    Accepts a ``datasets.Dataset`` (its ``column``), one of its columns (``ds["input_ids"]``), a ``pyarrow``
    ``ListArray``/``LargeListArray``/``ChunkedArray``, a ``(flat, offsets)`` pair of numpy arrays, a token
    source, or (slow path, small data) a sequence of token lists.
    """
    if isinstance(sequences, _SourceMixin):
        return sequences
    if isinstance(sequences, tuple) and len(sequences) == 2 and all(isinstance(a, np.ndarray) for a in sequences):
        return TokenView.from_flat(*sequences)
    module = type(sequences).__module__
    if module.startswith("pyarrow"):
        return view_of_arrow(sequences)
    if module.startswith("datasets"):
        if hasattr(sequences, "column_names"):  # a Dataset
            return view_of_dataset(sequences, column)
        if hasattr(sequences, "source") and hasattr(sequences, "column_name"):  # a lazy Column of a Dataset
            return view_of_dataset(sequences.source, sequences.column_name)
    lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
    flat = np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int64, count=int(lengths.sum()))
    return TokenView.from_flat(flat, np.concatenate([[0], np.cumsum(lengths)]))
