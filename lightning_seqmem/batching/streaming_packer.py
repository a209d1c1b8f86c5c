"""Streaming packer: an unbounded stream of token lists packed on the fly inside a bounded best-fit window."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from lightning_seqmem.batching.packed_rows import check_packing, pack_sequences
from lightning_seqmem.batching.truncation import check_max_length


class StreamingPacker:
    """Pack an (unbounded) stream of token lists on the fly with best fit inside a bounded window.

    Documents are buffered until ``buffer_size`` of them are waiting, then best-fit decreasing packs the buffer;
    full rows (no room for the shortest waiting document) are emitted and the rest stay in the window. Memory
    is bounded by the window, not the dataset.

    Args:
        max_length: row capacity, >= 2.
        buffer_size: documents held at most before packing.
        overflow: as in ``pack_sequences`` (``"split"``, ``"truncate"``, ``"drop"``, ``"error"``).

    Yields:
        ``{"input_ids": list[int], "seq_lengths": list[int]}`` rows (what ``PackCollator`` takes).
    """

    def __init__(self, max_length: int, buffer_size: int = 1000, overflow: str = "split") -> None:
        check_max_length(max_length)
        check_packing("bfd", overflow)
        if buffer_size < 1:
            raise ValueError(f"buffer_size={buffer_size} must be >= 1.")
        self.max_length = max_length
        self.buffer_size = buffer_size
        self.overflow = overflow

    def _pieces(self, index: int, ids: list[int]) -> list[list[int]]:
        m = self.max_length
        if len(ids) <= m:
            return [ids]
        if self.overflow == "error":
            raise ValueError(
                f"document at row {index} has {len(ids)} tokens > max_length={m}; "
                "use overflow='split', 'truncate' or 'drop', or raise max_length."
            )
        if self.overflow == "drop":
            return []
        if self.overflow == "truncate":
            return [ids[:m]]
        return [ids[i : i + m] for i in range(0, len(ids), m)]

    def _emit(self, pieces: list[list[int]], final: bool) -> tuple[list[dict], list[list[int]]]:
        res = pack_sequences(pieces, self.max_length, overflow="error")
        shortest = min(len(p) for p in pieces)
        rows, keep = [], []
        for r in range(res.num_rows):
            row = res.row(r)
            if final or self.max_length - len(row["input_ids"]) < shortest:
                rows.append(row)
            else:  # still room: give its documents another chance with the next window
                cuts = np.cumsum([0] + row["seq_lengths"])
                keep.extend(row["input_ids"][a:b] for a, b in zip(cuts[:-1], cuts[1:]))
        return rows, keep

    def __call__(self, sequences: Iterable[Sequence[int]]) -> Iterator[dict[str, list[int]]]:
        buffer: list[list[int]] = []
        for index, ids in enumerate(sequences):
            if len(ids):
                buffer.extend(self._pieces(index, list(ids)))
            if len(buffer) >= self.buffer_size:
                rows, buffer = self._emit(buffer, final=False)
                yield from rows
                if len(buffer) >= self.buffer_size:  # nothing full: emit anyway so the window stays bounded
                    rows, buffer = self._emit(buffer, final=True)
                    yield from rows
        if buffer:
            yield from self._emit(buffer, final=True)[0]
