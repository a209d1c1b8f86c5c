"""Saved stream readers dealt to another number of readers (loader workers or ranks): no document lost or read
twice, the rows in flight packed anew (docs/resuming.md). No Lightning import."""

from __future__ import annotations

from typing import Any

from lightning_seqmem.batching.streaming_packer import pieces_state, window_pieces
from lightning_seqmem.streams.readers import Layout, merge_positions

__all__ = ["Regrouped"]


class Regrouped:
    """Saved readers dealt to another number of readers (workers or ranks): each shard goes on from its position
    (positions are by shard, so any reader can take any shard), and the documents that were in the saved packing
    windows and shuffle buffers are dealt out to be packed again, saved reader ``j`` to new reader ``j`` mod their
    count. No document is lost or read twice; the rows in flight are packed anew.

    A stream whose shards do not divide by the ranks is read by every rank, each keeping its own documents of every
    shard: there a rank's readers are regrouped among themselves (another number of workers, the same ranks).
    """

    def __init__(self, readers: list[dict[str, Any]], fields: tuple[str, ...]) -> None:
        self.readers = [r for r in readers if not r.get("fresh")]
        self.epoch = readers[0]["epoch"] if readers else 0
        self.passes = max((r.get("passes", 0) for r in self.readers), default=0)
        self.fields = fields

    def share(self, rank: int, world: int, worker: int, workers: int) -> dict[str, Any]:
        """Reader ``(rank, worker)``'s start: its shards' positions and its deal of the saved windows, shuffle
        buffers and counts (readers numbered rank-major, as they were saved)."""
        layout = next((r["layout"] for r in self.readers if r.get("layout")), None)
        whole = layout is None or Layout(**layout).whole
        if whole:
            me, count, pool = rank * workers + worker, world * workers, self.readers
        else:  # every rank read every shard: only this rank's own readers know its place
            me, count, pool = worker, workers, [r for r in self.readers if r.get("rank") == rank]
        mine = [r for j, r in enumerate(pool) if j % count == me]
        pieces = [p for r in mine if r.get("window") for p in window_pieces(r["window"])]
        counts = None
        if mine:
            columns = list(zip(*(r["counts"] for r in mine)))
            counts = [max(c) if f == "longest_document" else sum(c) for f, c in zip(self.fields, columns)]
        drawn = [e for r in mine if r.get("shuffled") for e in r["shuffled"]["buffer"]]
        shuffled = {"buffer": drawn, "rng": None} if drawn else None
        positions = merge_positions([r.get("positions") or {} for r in pool])
        out = {"positions": positions, "window": pieces_state(pieces), "counts": counts, "passes": self.passes}
        return dict(out, shuffled=shuffled)
