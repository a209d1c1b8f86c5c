"""A mix of streams: each source's packed rows, read as they come, interleaved by the same rule as map-style mixes.

A stream's rows are not known ahead, so the order is decided one row at a time: each source's next row is read
(peeked) first, and :func:`interleave.choose` picks among those heads. The bound of ``interleave`` holds on every
prefix of one reader's rows: in the main process (``num_workers=0``) that is every prefix of the training batches;
with ``W`` loader workers each batch comes from one worker, each worker's rows hold the bound, and every prefix of
the batches is within ``W`` rows of each share. No Lightning import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch.utils.data import IterableDataset

from lightning_seqmem.mixing.interleave import choose

_END = object()


def row_tokens(row: dict[str, Any]) -> int:
    """Tokens of a packed row (``{"input_ids", "seq_lengths"[, "labels"]}``, unpadded)."""
    return len(row["input_ids"])


def row_documents(row: dict[str, Any]) -> int:
    """Documents (pieces of documents) of a packed row."""
    return len(row["seq_lengths"])


class MixedRows(IterableDataset):
    """Rows of several row streams, interleaved so every prefix holds each source's share within one row.

    Args:
        sources: per source, an iterable of packed rows (``datamodule.streaming.StreamingRows``); iterated again for
            each pass (``epoch`` is set on it when it has one, so a shuffled stream is dealt anew).
        weights: ``[sources]`` shares summing to 1 (weight 0: never read).
        exhausted: ``"stop"``: the rows end when the first source ends; ``"repeat"``: a source that ends is read
            again until every source has ended once. A source that never ends (a stream repeated under DDP) makes
            the mix endless: stop training with ``max_steps``.
        units: what a weight counts in a row (:func:`row_tokens` or :func:`row_documents`).
    """

    def __init__(
        self,
        sources: Sequence[Iterable[dict[str, Any]]],
        weights: Sequence[float],
        exhausted: str = "repeat",
        units: Callable[[dict[str, Any]], int] = row_tokens,
    ) -> None:
        self.sources, self.weights = list(sources), [float(w) for w in weights]
        self.exhausted, self.units = exhausted, units
        self._epoch = 0
        self.last_state: dict[str, Any] = {}  # the mixer's counts when the reader last stopped (main process)

    @property
    def epoch(self) -> int:
        return self._epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        """Set by ``StreamingLoader`` on each new iteration; each source's passes count from it."""
        self._epoch = value

    def _start(self, s: int, passes: int):
        source = self.sources[s]
        if hasattr(source, "epoch"):  # a StreamingRows: its stream reshuffled for this pass
            source.epoch = self._epoch + passes
        return iter(source)

    def __iter__(self):
        k = len(self.sources)
        active = [s for s in range(k) if self.weights[s] > 0]
        served, rows, passes = [0] * k, [0] * k, [0] * k
        readers = {s: self._start(s, 0) for s in active}
        heads = {s: next(readers[s], _END) for s in active}
        total = 0
        try:
            while True:
                for s in active:
                    if heads[s] is _END:  # this source ended: its pass is done
                        passes[s] += 1
                        if self.exhausted == "stop" or all(passes[a] > 0 for a in active):
                            return
                        readers[s] = self._start(s, passes[s])
                        heads[s] = next(readers[s], _END)
                        if heads[s] is _END:
                            return  # a pass that gives no row: repeating it would spin forever
                sizes = [self.units(heads[s]) if s in heads else 0 for s in range(k)]
                s = choose(self.weights, served, total, sizes)
                row = heads[s]
                served[s] += sizes[s]
                total += sizes[s]
                rows[s] += 1
                heads[s] = next(readers[s], _END)
                yield row
        finally:
            self.last_state = {"served": served, "rows_served": rows, "passes": passes}
