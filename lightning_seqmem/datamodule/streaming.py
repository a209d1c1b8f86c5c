"""Streaming datasets (``datasets.IterableDataset``): tokenized and packed on the fly, memory bounded by a window.

``SeqMemDataModule`` hands a stream here instead of to the split pipeline: the whole split is never held, so only
strategies that pack can serve it. Text streams and conversation streams (a ``messages`` column: rendered, cut by
whole turns to ``max_length``, their labels packed with them) are served. No Lightning import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_seqmem.batching import StreamingPacker
from lightning_seqmem.batching.strategies import Strategy
from lightning_seqmem.data.encode import document_frame

__all__ = ["StreamingRows", "check_streaming", "encode_document", "encode_streamed_conversation", "is_stream",
           "stream_kind", "streaming_loader", "streaming_splits"]


def is_stream(dataset: Any) -> bool:
    """Whether ``dataset`` is a ``datasets`` stream (``IterableDataset``/``IterableDatasetDict``)."""
    import datasets

    return isinstance(dataset, (datasets.IterableDataset, datasets.IterableDatasetDict))


class StreamingRows(IterableDataset):
    """A text stream tokenized and packed on the fly; rank ``r`` and worker ``w`` take every n-th document.

    Memory is bounded by the packer's window. With ``cycle`` the stream restarts when it ends, so DDP ranks
    (whose shares differ in length) never wait on each other; stop training with ``max_steps``.
    """

    def __init__(self, stream, encode, packer: StreamingPacker, rank: int, world: int, cycle: bool) -> None:
        self.stream, self.encode, self.packer = stream, encode, packer
        self.rank, self.world, self.cycle = rank, world, cycle

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        shard, shards = self.rank * workers + worker, self.world * workers
        while True:
            mine = (self.encode(i, ex) for i, ex in enumerate(self.stream) if i % shards == shard)
            yield from self.packer(mine)
            if not self.cycle:
                return


def stream_kind(stream: Any, text_column: str = "text") -> str:
    """``"text"`` or ``"conversations"``, from the stream's columns (its features, else its first row).

    Raises:
        ValueError: columns of another kind (prompt/completion, preference pairs, token ids), which need the whole
            split: the message says to load without ``streaming=True``.
    """
    from lightning_seqmem.data.conversations import MESSAGES_COLUMN, check_conversation_columns

    train = stream["train"] if isinstance(stream, dict) else stream
    features = getattr(train, "features", None)
    columns = set(features) if features else set(next(iter(train.take(1)), {}))
    if check_conversation_columns(columns, other_columns=(text_column, "prompt", "completion")):
        return "conversations"
    if text_column in columns:
        return "text"
    raise ValueError(
        f"A streaming dataset is tokenized and packed on the fly from a {text_column!r} column (text) or a "
        f"{MESSAGES_COLUMN!r} column (conversations); this one has {sorted(columns)}. Prompt/completion data, "
        "preference pairs and token ids need the whole split (their truncation is planned over it): load the "
        "dataset without streaming=True (the token cache tokenizes it once per node and memory-maps the tokens, "
        f"so memory stays bounded), or pass text_column=<name>."
    )


def encode_streamed_conversation(renderer: Any, settings: Any, max_length: int, index: int,
                                 example: dict) -> dict[str, list[int]] | list[int]:
    """One streamed conversation to ``{"input_ids", "labels"}``, cut by whole turns to ``max_length`` as the
    split pipeline cuts them; one with no trained token is skipped (``[]``) or refused, by ``on_empty_labels``."""
    from lightning_seqmem.data.chat_truncation import truncate
    from lightning_seqmem.data.conversations import MESSAGES_COLUMN, encode_conversation, select_trained

    row = f"{index} of the stream"
    conversation = truncate(encode_conversation(example.get(MESSAGES_COLUMN), renderer, row, settings), max_length)
    kept, _ = select_trained([conversation.num_trained], settings.on_empty_labels, rows=[row])
    if not len(kept):
        return []
    return {"input_ids": conversation.input_ids.tolist(), "labels": conversation.labels().tolist()}


def check_streaming(strategies: dict[str, Strategy]) -> None:
    """Refuse a stream for strategies that need the whole dataset (every split must pack)."""
    if not all(strategy.packs for strategy in strategies.values()):
        raise ValueError(
            f"A streaming dataset is packed on the fly: use strategy='pack' (strategy={strategies['train'].name!r}, "
            f"eval_strategy={strategies['validation'].name!r}; the others need the whole dataset), or load it "
            "without streaming=True."
        )


def streaming_splits(dataset: Any, validation_documents: int) -> dict[str, Any]:
    """``{"train", "validation"}`` streams: the dataset's own validation split, else its first
    ``validation_documents`` documents (which training then skips)."""
    train, val = (dataset["train"], dataset.get("validation")) if isinstance(dataset, dict) else (dataset, None)
    if val is None:
        train, val = train.skip(validation_documents), train.take(validation_documents)
    return {"train": train, "validation": val}


def encode_document(tokenizer: Any, text_column: str, index: int, example: dict) -> list[int]:
    """One streamed document to ``[bos] + tokens + [eos]``, as ``data.encode`` does for map-style data."""
    text = example.get(text_column)
    if not isinstance(text, str):
        raise TypeError(
            f"Row {index} of the stream: column {text_column!r} is {type(text).__name__}, not a string. "
            "Filter the stream (stream.filter(...)) or pass text_column=<name>."
        )
    if not text:
        return []  # skipped by the packer
    prefix, suffix = document_frame(tokenizer)
    return prefix + tokenizer(text, add_special_tokens=False)["input_ids"] + suffix


def streaming_loader(stream: Any, split: str, strategy: Strategy, encode: Callable[[int, dict], list[int]],
                     buffer_size: int, pad_token_id: int, num_workers: int, warn: Callable[[str], None]) -> DataLoader:
    """The loader of one stream: this rank's share of documents, packed by ``strategy``'s settings."""
    initialised = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if initialised else (1, 0)
    cycle = world > 1 and split == "train"
    if cycle:
        warn("Streaming under DDP: the train stream repeats so no rank runs out first; set max_steps.")
    packer = StreamingPacker(strategy.settings.max_length, buffer_size, strategy.overflow)
    rows = StreamingRows(stream, encode, packer, rank, world, cycle=cycle)
    return DataLoader(rows, batch_size=strategy.rows_per_batch(split), collate_fn=strategy.collator(pad_token_id),
                      num_workers=num_workers)
