"""What the planner plans on, per split: document lengths, pair lengths, or conversations cut per candidate
``max_length``.

Each data kind says what a split of it is planned on (``kinds.Kind.plan_lengths``). Text lengths do not depend on
``max_length``; a conversation's rows do, so conversations come as ``batching.conversation_rows.ConversationLengths``,
cut per candidate the way ``SeqMemDataModule.setup`` cuts them. No Lightning import.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lightning_seqmem.batching.conversation_rows import ConversationLengths


def lengths_at(docs: Any, max_length: int) -> tuple[np.ndarray, int, int | None]:
    """Documents of a split at ``max_length``: ``(lengths, tokens lost before batching, trained tokens or None)``;
    text ``[documents]`` and pair ``[pairs, 3]`` lengths are returned as they are."""
    if isinstance(docs, ConversationLengths):
        return docs.at(max_length)
    return np.asarray(docs, dtype=np.int64), 0, None


def whole_lengths(docs: Any) -> np.ndarray:
    """The lengths before any cut: a conversation's whole token count, else the lengths given."""
    return docs.lengths if isinstance(docs, ConversationLengths) else np.asarray(docs)


def stream_sample(dm: Any, documents: int = 20_000) -> tuple[Any, int | None]:
    """``(a map-style copy of a streaming DataModule over its stream's first documents, how many)``, or ``(dm,
    None)`` when ``dm`` does not stream.

    A stream's lengths are known only as it is read, so the planner reads a sample: the first ``documents`` of the
    train split (and of the stream's own validation split, if any), with the DataModule's other settings. Lengths,
    token efficiency and memory carry over to the whole stream; counts and steps per epoch are the sample's.
    """
    import numbers

    import datasets

    from lightning_seqmem.data.sources import open_stream
    from lightning_seqmem.datamodule.streaming import is_stream

    if isinstance(documents, bool) or not isinstance(documents, numbers.Integral) or documents < 1:
        raise ValueError(
            f"plan.stream_sample must be an int >= 1 (documents read from a stream to plan on), got {documents!r}."
        )
    if not (dm.settings.data.streaming or is_stream(dm.dataset)):
        return dm, None
    stream = open_stream(dm.dataset)
    splits = stream if isinstance(stream, dict) else {"train": stream}
    head = datasets.DatasetDict(
        {
            split: datasets.Dataset.from_list(list(s.take(documents)))
            for split, s in splits.items()
            if split in ("train", "validation")
        }
    )
    copy = type(dm)(dataset=head, tokenizer=dm._tokenizer_arg, **dict(dm.hparams, streaming=False))
    return copy, len(head["train"])


__all__ = ["lengths_at", "stream_sample", "whole_lengths"]
