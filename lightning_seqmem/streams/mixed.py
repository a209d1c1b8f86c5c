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

import torch
from torch.utils.data import IterableDataset

from lightning_seqmem.mixing.interleave import choose
from lightning_seqmem.streams.state import MixerState

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
        sources: per source, an iterable of packed rows (``streams.rows.StreamingRows``); iterated again for
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
        self._live: dict[str, Any] | None = None  # the counts and heads while it reads
        self._saved: MixerState | None = None  # where the next pass starts (load_state_dict)

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Called by ``StreamingLoader`` on each new iteration; each source's passes count from it."""
        self._epoch = epoch

    def _start(self, s: int, passes: int):
        source = self.sources[s]
        if hasattr(source, "set_epoch"):  # a StreamingRows: its stream reshuffled for this pass
            source.set_epoch(self._epoch + passes)
        return iter(source)

    def __iter__(self):
        k = len(self.sources)
        active = [s for s in range(k) if self.weights[s] > 0]
        saved, self._saved = self._saved, None
        if saved is not None and saved.epoch == self._epoch:  # resumed: the counts and the rows read ahead
            served, rows, passes, total = list(saved.served), list(saved.rows), list(saved.passes), saved.total
            heads = {s: _row_from(saved.heads[s]) for s in active}
        else:
            served, rows, passes, total, heads = [0] * k, [0] * k, [0] * k, 0, None
        readers = {s: self._start(s, passes[s]) for s in active}
        if heads is None:
            heads = {s: next(readers[s], _END) for s in active}
        self._live = {"served": served, "rows": rows, "passes": passes, "heads": heads, "total": total}
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
                s = choose(self.weights, served, self._live["total"], sizes)
                row = heads[s]
                served[s] += sizes[s]
                self._live["total"] += sizes[s]
                rows[s] += 1
                heads[s] = next(readers[s], _END)
                yield row
        finally:
            self.last_state = {"served": served, "rows_served": rows, "passes": passes}

    def state_dict(self) -> dict[str, Any]:
        """The mixer's counts, the row each source has read ahead (its head), and each source's own state
        (``StreamingRows.state_dict``: shards, window, counts); torchdata asks each loader worker after each batch."""
        live = self._live
        if live is None:
            return (self._saved or MixerState(epoch=self._epoch, fresh=True)).to_dict()
        return MixerState(
            epoch=self._epoch,
            served=list(live["served"]),
            rows=list(live["rows"]),
            passes=list(live["passes"]),
            total=live["total"],
            heads={s: _row_state(head) for s, head in live["heads"].items()},
            sources=[source.state_dict() if hasattr(source, "state_dict") else None for source in self.sources],
        ).to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on where ``state`` stopped: each source from its own state, the mixer from its counts and heads."""
        saved = MixerState.from_dict(state)
        if saved.fresh:
            return
        self._saved, self._live = saved, None
        for source, source_state in zip(self.sources, saved.sources):
            if source_state is not None:
                source.load_state_dict(source_state)


def _row_state(row: Any) -> Any:
    """A packed row as tensors (a checkpoint loads them with ``weights_only=True``); ``"end"`` for a source that
    ended."""
    if row is _END:
        return "end"
    return {key: torch.tensor(values, dtype=torch.int64) for key, values in row.items()}


def _row_from(state: Any) -> Any:
    if isinstance(state, str):
        return _END
    return {key: values.tolist() for key, values in state.items()}
