"""A stream tokenized and packed on the fly, one reader per loader worker, its whole position a state.

What decides the next row of a reader is all here, behind ``state_dict``/``load_state_dict``: the position in each
of its shards (``readers``), the documents waiting in the packing window and the rows packed but not yet
handed out (``PackingWindow``), the pass and the document count, and what it has counted so far. torchdata's
``StatefulDataLoader`` asks each loader worker for it after every batch; a resumed worker starts where its saved
self stopped. A resume with other readers (workers or ranks) gets :class:`Regrouped` instead. No Lightning import.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from lightning_seqmem.batching.streaming_packer import StreamingPacker
from lightning_seqmem.data.line_ranges import MARK as LINE_RANGES
from lightning_seqmem.streams.counts import StreamCounts
from lightning_seqmem.streams.readers import (
    Layout,
    OrderedReader,
    ShardReader,
    ShuffleBuffer,
    can_shard,
)
from lightning_seqmem.streams.regroup import Regrouped
from lightning_seqmem.streams.splits import LEFT_OUT, left_out_warning
from lightning_seqmem.streams.state import ReaderState

__all__ = ["StreamingRows"]


class StreamingRows(IterableDataset):
    """A stream tokenized and packed on the fly.

    ``stream`` is the whole stream; each reader (rank ``rank`` of ``world``, and its loader worker) reads its own
    shards of it (``readers.Layout``). Memory is bounded by the packer's window. With ``cycle`` the stream
    restarts when it ends, so DDP ranks (whose shares differ in length) never wait on each other; stop training with
    ``max_steps``. With ``reshuffle`` every pass sets the stream's epoch (``set_epoch``), so a shuffled stream
    (``stream.shuffle(...)``) is dealt anew each epoch. With ``required`` (training), a pass that gives no row is an
    error in the main process, and ends a loader worker (one with no file of its own) instead of repeating nothing
    forever. With ``leave_out`` (a training stream whose validation head was carved out of it,
    ``splits.NotIn``), each document equal to a validation document is left out and counted, and a pass that
    left out copies of them says so (``on_left_out``). ``on_replay``: told how many documents a source that cannot
    seek reads again on resume.
    """

    def __init__(
        self,
        stream,
        encode,
        packer: StreamingPacker,
        cycle: bool = False,
        counts: Any = None,
        on_loss: Callable[[], None] | None = None,
        reshuffle: bool = True,
        required: bool = False,
        leave_out: Any = None,
        on_left_out: Callable[[str], None] | None = None,
        rank: int = 0,
        world: int = 1,
        on_replay: Callable[[str], None] | None = None,
        shuffle: int = 0,
        seed: int = 0,
    ) -> None:
        self.stream, self.encode, self.packer, self.cycle = stream, encode, packer, cycle
        self.counts = counts if counts is not None else StreamCounts()
        self.on_loss, self.reshuffle, self.required = on_loss, reshuffle, required
        self.leave_out, self.on_left_out, self.on_replay = leave_out, on_left_out, on_replay
        self.rank, self.world, self.shuffle, self.seed = rank, world, shuffle, seed
        self.epoch = 0
        self.live: dict[str, Any] | None = None  # this reader's position while it reads
        self.saved: dict[str, Any] | None = None  # where the next pass starts (load_state_dict)
        self.regrouped: Regrouped | None = None  # a resume with other readers
        self._replay_said = False  # a source that cannot seek says so once

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration reads (``StreamingLoader`` and ``MixedRows`` call it before each pass)."""
        self.epoch = epoch

    def regroup(self, readers: list[dict[str, Any]]) -> None:
        """Start the next pass from ``readers``, saved by another number of readers (workers or ranks)."""
        self.regrouped = Regrouped(readers, self.counts.FIELDS)

    def layout(self, workers: int) -> Layout | None:
        """How the stream is dealt to ``workers`` loader workers per rank (``None``: read in order, one reader)."""
        if not can_shard(self.stream):
            return None
        return Layout(self.stream.num_shards, self.world, max(1, workers))

    def _start(self, worker: int, workers: int) -> ReaderState:
        """The reader's position at the start of iteration: saved, regrouped, or the epoch's first document."""
        fresh = ReaderState(epoch=self.epoch)
        if self.saved is not None:
            state, self.saved = self.saved, None
            return state if state.epoch == self.epoch else fresh
        if self.regrouped is not None and self.regrouped.epoch == self.epoch:
            return replace(fresh, **self.regrouped.share(self.rank, self.world, worker, workers))
        return fresh

    def __iter__(self):
        info = get_worker_info()
        slot, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if slot >= len(self.counts.table):
            raise ValueError(
                f"StreamCounts has a row for {len(self.counts.table)} loader worker(s), and this is "
                f"worker {slot}: build it with StreamCounts(num_workers)."
            )
        state = self._start(slot, workers)
        layout = self.layout(workers)
        total = Counter(dict(zip(self.counts.FIELDS, state.counts or self.counts.table[slot].tolist())))
        window = self.packer.window()
        if state.window is not None:
            window.load_state_dict(state.window)
        positions, passes, index = state.positions, state.passes, state.index
        live = self.live = {"epoch": self.epoch, "layout": layout and layout.as_dict(), "rank": self.rank}
        live.update(worker=slot, passes=passes, index=index, window=window, counts=total, pass_start=None)
        live["shuffled"] = None
        while True:
            if self.reshuffle and hasattr(self.stream, "set_epoch"):
                self.stream.set_epoch(self.epoch + live["passes"])  # a repeated stream is dealt anew each pass
            reader = self._reader(layout, slot, positions)
            live["reader"], warned, drawn = reader, False, reader
            if self.shuffle:
                seed = (self.seed, self.epoch, live["passes"], self.rank, slot)
                drawn = live["shuffled"] = ShuffleBuffer(reader, self.shuffle, seed, state.shuffled)
            live["pass_start"] = state.pass_start or [total["rows"], total[LEFT_OUT]]
            state.shuffled, state.pass_start = None, None  # the resumed pass only
            for example in drawn:
                if self.leave_out is not None and not self.leave_out(example):
                    total[LEFT_OUT] += 1
                    continue
                item = self.encode(live["index"], example, total)
                live["index"] += 1
                window.add(live["index"] - 1, item, total)
                for _ in range(window.due(steady=info is not None)):
                    warned = self._hand_out(slot, total, warned)
                    yield window.pop(total)
            window.finish()
            while window.ready:
                warned = self._hand_out(slot, total, warned)
                yield window.pop(total)
            self._publish(slot, total)
            live["passes"] += 1
            positions, live["index"] = {}, 0
            pass_rows, pass_left = live["pass_start"]
            message = left_out_warning(total[LEFT_OUT] - pass_left, self.leave_out.held) if self.leave_out else None
            if message and self.on_left_out is not None:
                self.on_left_out(message)
            if self.required and total["rows"] == pass_rows:
                if info is not None:
                    return  # a loader worker with no file to read: it stops (repeating nothing would spin forever)
                raise ValueError(
                    f"This process's share of the training stream holds no document to train on "
                    f"({total['documents']} read, all empty or dropped): a training loop would run empty epochs. "
                    "Give the stream more documents, or files (shards) that every rank can have one of."
                )
            if not self.cycle:
                return

    def _reader(self, layout: Layout | None, worker: int, positions: Any):
        if layout is None:
            if worker > 0:
                return iter(())  # a source read in order has one reader: the first worker
            return OrderedReader(self.stream, positions or 0, self._replay)
        shards = layout.shards_of(self.rank, worker)
        return ShardReader(self.stream, shards, layout.stride(self.rank), positions, self._replay)

    def _replay(self, count: int) -> None:
        if getattr(getattr(self.stream, "info", None), "description", None) == LINE_RANGES:
            return  # local line files: at most one range is read again, a seek in all but name
        if self.on_replay is not None and not self._replay_said:
            self._replay_said = True
            self.on_replay(
                f"train stream: this source cannot seek (a generator, or a list read in order), so the resumed run "
                f"reads {count:,} documents again and drops them before training goes on (exactly where it stopped, "
                "at the cost of reading them). Files and Arrow data seek: stream those to resume at once."
            )

    def _hand_out(self, slot: int, total: Counter, warned: bool) -> bool:
        """Before a row leaves: publish the counts (with it), and warn once a pass about tokens lost."""
        total["rows"] += 1
        self._publish(slot, total)
        total["rows"] -= 1  # ``pop`` counts it
        if not warned and (total["tokens_truncated"] or total["tokens_dropped"]) and self.on_loss is not None:
            self.on_loss()
            return True
        return warned

    def _publish(self, slot: int, total: Counter) -> None:
        self.counts.table[slot] = torch.tensor([total[name] for name in self.counts.FIELDS], dtype=torch.int64)

    def state_dict(self) -> dict[str, Any]:
        """This reader's position: torchdata asks each loader worker after each batch (the main process when it
        has none). Before the first row: where the next pass would start."""
        live = self.live
        if live is None:
            return (self.saved or ReaderState(epoch=self.epoch, fresh=True)).to_dict()
        reader = live.get("reader")
        return ReaderState(
            epoch=live["epoch"],
            passes=live["passes"],
            index=live["index"],
            positions=reader.state_dict() if reader is not None else {},
            window=live["window"].state_dict(),
            counts=[live["counts"][name] for name in self.counts.FIELDS],
            pass_start=live["pass_start"],
            shuffled=live["shuffled"].state_dict() if live["shuffled"] is not None else None,
            layout=live["layout"],
            rank=live["rank"],
            worker=live["worker"],
        ).to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start the next pass where ``state`` stopped (torchdata calls this in each worker before it iterates)."""
        saved = ReaderState.from_dict(state)
        self.saved = None if saved.fresh else saved
        self.live = None
