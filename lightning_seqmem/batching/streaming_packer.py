"""Streaming packer: an unbounded stream of token lists packed on the fly inside a bounded best-fit window."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence

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

    Takes token lists, or ``{"input_ids", "labels"}`` items whose labels travel with their tokens (cut alike).
    With ``steady``, rows leave evenly over the documents read while the window fills again (for loader
    workers), else as soon as they are packed. Given a ``Counter``, adds what overflow did to each document (``documents_over_max_length``,
    ``documents_split``, ``tokens_truncated``, ``tokens_dropped``) and the ``rows`` it yields, as it goes.

    Yields:
        ``{"input_ids": list[int], "seq_lengths": list[int]}`` rows (what ``PackCollator`` takes), with ``labels``
        where the items brought them.
    """

    def __init__(self, max_length: int, buffer_size: int = 1000, overflow: str = "split") -> None:
        check_max_length(max_length)
        check_packing("bfd", overflow)
        if buffer_size < 1:
            raise ValueError(f"buffer_size={buffer_size} must be >= 1.")
        self.max_length = max_length
        self.buffer_size = buffer_size
        self.overflow = overflow

    def _pieces(
        self, index: int, ids: list[int], labels: list[int] | None, counts: Counter
    ) -> list[tuple[list[int], list[int] | None]]:
        m = self.max_length
        if len(ids) <= m:
            return [(ids, labels)]
        if self.overflow == "error":
            raise ValueError(
                f"document at row {index} has {len(ids)} tokens > max_length={m}; "
                "use batching=Pack(overflow='split'), Pack(overflow='truncate') or Pack(overflow='drop'), or raise "
                "max_length."
            )
        counts["documents_over_max_length"] += 1
        if self.overflow == "drop":
            counts["tokens_dropped"] += len(ids)
            return []
        if self.overflow == "truncate":
            counts["tokens_truncated"] += len(ids) - m
        else:
            counts["documents_split"] += 1
        cuts = [0] if self.overflow == "truncate" else range(0, len(ids), m)
        return [(ids[i : i + m], labels[i : i + m] if labels is not None else None) for i in cuts]

    def _emit(self, pieces: list[tuple[list[int], list[int] | None]], final: bool) -> tuple[list[dict], list]:
        res = pack_sequences([ids for ids, _ in pieces], self.max_length, overflow="error")
        shortest = min(len(ids) for ids, _ in pieces)
        rows, keep = [], []
        for r in range(res.num_rows):
            members = [pieces[i] for i in res.segment_doc[res.seg_row_offsets[r] : res.seg_row_offsets[r + 1]]]
            used = sum(len(ids) for ids, _ in members)
            if final or self.max_length - used < shortest:
                rows.append(_row(members))
            else:  # still room: give its documents another chance with the next window
                keep.extend(members)
        return rows, keep

    def __call__(
        self,
        sequences: Iterable[Sequence[int] | Mapping[str, Sequence[int]]],
        counts: Counter | None = None,
        steady: bool = False,
    ) -> Iterator[dict[str, list[int]]]:
        counts = Counter() if counts is None else counts
        buffer: list[tuple[list[int], list[int] | None]] = []
        ready: deque[dict] = deque()  # packed rows, handed out evenly while the window fills again
        for index, item in enumerate(sequences):
            ids, labels = _ids_and_labels(item)
            if len(ids):
                buffer.extend(self._pieces(index, ids, labels, counts))
            if len(buffer) >= self.buffer_size:
                rows, buffer = self._emit(buffer, final=False)
                ready.extend(rows)
                if len(buffer) >= self.buffer_size:  # nothing full: emit anyway so the window stays bounded
                    rows, buffer = self._emit(buffer, final=True)
                    ready.extend(rows)
            # ``steady``: spread the rows over the documents still to read before the next packing, rather than all
            # at once. A loader worker then yields batches at a steady rate, and the DataLoader, which takes
            # batches from its workers in turn, never waits on one worker that is filling its window while another
            # sits on a burst of ready rows. (In one process a burst costs nothing, and handing rows out at once
            # is about 10 % faster.)
            due = len(ready) if not steady else -(-len(ready) // max(1, self.buffer_size - len(buffer)))
            for _ in range(due):
                counts["rows"] += 1
                yield ready.popleft()
        ready.extend(self._emit(buffer, final=True)[0] if buffer else [])
        while ready:
            counts["rows"] += 1
            yield ready.popleft()


def _ids_and_labels(item: Sequence[int] | Mapping[str, Sequence[int]]) -> tuple[list[int], list[int] | None]:
    """A stream item: token ids, or ``{"input_ids", "labels"}`` (a conversation's loss on its assistant turns)."""
    if isinstance(item, Mapping):
        labels = item.get("labels")
        return list(item["input_ids"]), (list(labels) if labels is not None else None)
    return list(item), None


def _row(members: list[tuple[list[int], list[int] | None]]) -> dict[str, list[int]]:
    """One packed row (what ``PackCollator`` takes); ``labels`` where any of its documents brought its own."""
    row = {"input_ids": [t for ids, _ in members for t in ids], "seq_lengths": [len(ids) for ids, _ in members]}
    if any(labels is not None for _, labels in members):
        row["labels"] = [t for ids, labels in members for t in (labels if labels is not None else ids)]
    return row
