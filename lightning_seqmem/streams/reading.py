"""Streaming datasets (``datasets.IterableDataset``): tokenized and packed on the fly, memory bounded by a window.

``SeqMemDataModule`` hands a stream here instead of to the split pipeline: the whole split is never held, so only
strategies that pack can serve it. Streams of text, conversations (a ``messages`` column: rendered, cut by whole
turns to ``max_length``, their labels packed with them), prompt/completion text and token ids are served, each
example encoded and cut by its kind's own map function and rule (``Kind.stream_encoder``), as map-style splits are.

Each rank reads its own share (``datasets.distributed.split_dataset_by_node``: whole shards where they divide
evenly) and ``datasets`` deals those shards out to the loader's workers, so no document is read twice or skipped.
What a stream loses to ``max_length`` cannot be known before it is read: :class:`StreamCounts` counts it as it is
read, in every worker, and ``stats()`` reports it. No Lightning import.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from lightning_seqmem.batching.strategies import Strategy
from lightning_seqmem.batching.streaming_packer import StreamingPacker
from lightning_seqmem.kinds.base import DOCUMENT_STATS, Kind
from lightning_seqmem.streams.counts import StreamCounts
from lightning_seqmem.streams.loader import ResumePolicy, StreamingLoader
from lightning_seqmem.streams.rows import StreamingRows
from lightning_seqmem.streams.splits import LEFT_OUT, streaming_splits

__all__ = ["DealtBatches", "Streams", "check_streaming", "is_stream", "layout_warnings", "streaming_loader"]


def is_stream(dataset: Any) -> bool:
    """Whether ``dataset`` is a ``datasets`` stream (``IterableDataset``/``IterableDatasetDict``)."""
    import datasets

    return isinstance(dataset, (datasets.IterableDataset, datasets.IterableDatasetDict))


class DealtBatches(IterableDataset):
    """Rank ``rank``'s batches of a whole stream's rows, dealt as the map-style samplers deal them
    (``sampling.balanced_batch_sizes``): every rank the same number of batches, no row repeated or left out.

    For validation under DDP/FSDP, where a rank that ran out first would leave the others waiting in a collective
    forward (FSDP's all-gathers). Every rank reads the whole stream (a validation split is small), and the row
    count is found by one pass when the loader is made, so no collective is needed.
    """

    def __init__(self, rows: StreamingRows, total_rows: int, rows_per_batch: int, rank: int, world: int) -> None:
        from lightning_seqmem.batching.sampling import balanced_batch_sizes

        self.rows, self.rank, self.world = rows, rank, world
        self.sizes = balanced_batch_sizes(total_rows, rows_per_batch, world)

    def __len__(self) -> int:
        return len(self.sizes[self.rank :: self.world])

    def __iter__(self):
        rows = iter(self.rows)
        mine = range(self.rank, len(self.sizes), self.world)
        for index, size in enumerate(self.sizes):
            batch = [next(rows) for _ in range(size)]
            if index == mine[-1]:
                for _ in rows:  # read to the end before the last batch, so the counts are whole
                    pass
                yield batch
                return
            if index in mine:
                yield batch


def check_streaming(strategies: dict[str, Strategy]) -> None:
    """Refuse a stream for strategies that need the whole dataset (every split must pack)."""
    if not all(strategy.packs for strategy in strategies.values()):
        raise ValueError(
            f"A streaming dataset is packed on the fly: use batching=Pack() for both loaders (batching="
            f"{strategies['train'].options!r}, eval_batching={strategies['validation'].options!r}; the others need the "
            "whole dataset), or load it without streaming=True."
        )


def streaming_loader(
    stream: Any,
    split: str,
    strategy: Strategy,
    encode: Callable[..., Any],
    buffer_size: int,
    pad_token_id: int,
    num_workers: int,
    warn: Callable[[str], None],
    counts: StreamCounts | None = None,
    leave_out: Any = None,
    shuffle: int = 0,
    seed: int = 0,
    policy: ResumePolicy | None = None,
) -> DataLoader:
    """The loader of one stream: this rank's share of documents, packed by ``strategy``'s settings; what it reads
    counted in ``counts``, and the first token lost to ``max_length`` on each pass warned about.

    Under DDP/FSDP the train stream is split by rank and repeats (``cycle``); a validation stream is read whole by
    every rank and its rows dealt out in equal numbers of batches (:class:`DealtBatches`). ``leave_out``: the
    training documents to leave out (copies of validation documents, ``splits.NotIn``), counted and warned.
    ``shuffle``: the training readers' shuffle buffer (``streaming_shuffle_buffer``), seeded by ``seed``.
    ``policy``: how the train loader resumes (``loader.ResumePolicy``).
    """
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    train = split == "train"
    if distributed and train:
        warn("Streaming under DDP: the train stream repeats so no rank runs out first; set max_steps.")
    max_length = strategy.settings.max_length
    packer = StreamingPacker(max_length, buffer_size, strategy.overflow)
    fix = (
        "raise max_length"
        if strategy.overflow == "split"
        else f"raise max_length or use batching=Pack(overflow='split') (overflow={strategy.overflow!r})"
    )
    lost = (
        f"{split} stream: documents longer than max_length={max_length} lose tokens as they are read "
        f"(conversations lose whole oldest turns); stats()[{split!r}] counts them so far. To keep them, {fix}."
    )
    per_batch, collate = strategy.rows_per_batch(split), strategy.collator(pad_token_id)
    if distributed and not train:
        rows = StreamingRows(stream, encode, packer, counts=counts, on_loss=partial(warn, lost), reshuffle=False)
        total = sum(1 for _ in StreamingRows(stream, encode, packer, reshuffle=False))
        dealt = DealtBatches(rows, total, per_batch, dist.get_rank(), dist.get_world_size())
        return DataLoader(dealt, batch_size=None, collate_fn=collate)
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    rows = StreamingRows(
        stream,
        encode,
        packer,
        cycle=distributed and train,
        counts=counts,
        on_loss=partial(warn, lost),
        reshuffle=train,
        required=train,
        leave_out=leave_out,
        on_left_out=warn,
        rank=rank,
        world=world,
        on_replay=warn,
        shuffle=shuffle,
        seed=seed,
    )
    held = isinstance(stream, list)  # validation documents held in memory: one reader, or each would read all
    num_workers = 0 if held else num_workers
    for message in layout_warnings(split, getattr(stream, "num_shards", None), world, num_workers):
        warn(message)
    if not train:
        return DataLoader(rows, batch_size=per_batch, collate_fn=collate, num_workers=num_workers)
    return StreamingLoader(rows, batch_size=per_batch, collate_fn=collate, num_workers=num_workers, policy=policy)


def layout_warnings(split: str, shards: int | None, world: int, num_workers: int) -> list[str]:
    """What wastes reading in how a stream of ``shards`` shards (files) is dealt to ``world`` ranks and
    ``num_workers`` loader workers per rank: ranks that cannot get whole files each read every document, and
    workers beyond a rank's files sit idle."""
    if not shards:
        return []
    out = []
    if world > 1 and shards % world:
        out.append(
            f"{split} stream: {shards} files (shards) cannot be dealt evenly to {world} ranks, so every rank "
            f"reads every document and keeps every {world}-th ({world}x the reading). Give it a multiple of "
            f"{world} files (more files, or stream.reshard() where the format allows)."
        )
    mine = shards // world if world > 1 and not shards % world else shards
    if num_workers > mine:
        out.append(
            f"{split} stream: {num_workers} loader workers but {mine} file(s) (shards) per rank: datasets "
            f"gives each worker whole files, so {num_workers - mine} worker(s) read nothing. Use "
            f"num_workers <= {mine}, or more files."
        )
    return out


class Streams:
    """The streamed splits of a DataModule: their loaders, and what each has read so far (``stats()``).

    Args:
        dataset: the stream (``IterableDataset``/``IterableDatasetDict``).
        kind: the stream's data kind (``kinds.detect_stream``).
        data: the DataModule's ``DataSettings`` (validation documents, window, workers).
    """

    def __init__(self, dataset: Any, kind: Kind, data: Any) -> None:
        self.read, self.leave_out = streaming_splits(dataset, data.streaming_validation_documents)
        # what a user sees as the train split: the stream less the validation documents (the loader leaves them
        # out itself, so that it counts them)
        left = {"train": self.read["train"].filter(self.leave_out)} if self.leave_out is not None else {}
        self.splits = {**self.read, **left}
        self.kind, self.buffer_size, self.num_workers = kind, data.streaming_buffer_size, data.num_workers
        self.counts = {split: StreamCounts(self.num_workers) for split in self.splits}

    def loader(
        self,
        split: str,
        strategy: Strategy,
        tokenizer: Any,
        settings: Any,
        pad_token_id: int,
        warn: Callable[[str], None],
        policy: ResumePolicy | None = None,
    ) -> DataLoader:
        """``split``'s loader (``settings``: the DataModule's ``SeqMemSettings``; ``policy``: how training
        resumes)."""
        encode = self.kind.stream_encoder(tokenizer, settings, strategy, split)
        return streaming_loader(
            self.read[split],
            split,
            strategy,
            encode,
            self.buffer_size,
            pad_token_id,
            self.num_workers,
            warn,
            self.counts[split],
            self.leave_out if split == "train" else None,
            settings.data.streaming_shuffle_buffer if split == "train" else 0,
            settings.batching.seed,
            policy,
        )

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per split, the counts so far on this process (a stream's totals are known only once it is read); for
        training also the documents left out as validation (``splits.LEFT_OUT``)."""
        keep = {*DOCUMENT_STATS, *self.kind.stats_keys, "rows"}  # not other kinds' keys
        return {
            split: {
                "streaming": True,
                "buffer_size": self.buffer_size,
                **{k: v for k, v in counts.totals().items() if k in keep or (k == LEFT_OUT and split == "train")},
            }
            for split, counts in self.counts.items()
        }
