"""What the planner plans on, per split: document lengths, pair lengths, or conversations cut per candidate
``max_length``.

Each data kind says what a split of it is planned on (``kinds.Kind.plan_lengths``). Text lengths do not depend on
``max_length``; a conversation's rows do, so conversations come as ``batching.conversation_rows.ConversationLengths``,
cut per candidate the way ``SeqMemDataModule.setup`` cuts them. No Lightning import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_seqmem.batching.conversation_rows import ConversationLengths
from lightning_seqmem.batching.truncation import PromptCompletionLengths
from lightning_seqmem.datamodule.pipeline import split_documents


@dataclass(frozen=True)
class MixSource:
    """One source of a ``Mix`` as the planner plans it: its data kind and what that kind plans a split on."""

    name: str
    weight: float
    kind: Any  # ``kinds.Kind``
    lengths: Any  # ``kind.plan_lengths`` of the split: ``[documents]``, ``ConversationLengths``, ...
    whole: np.ndarray  # ``[sequences]`` token counts before any cut (``kind.sequence_lengths``)
    times: float  # how many times over an epoch of the mix reads it (``plan_mix._takes``; validation: 1)


@dataclass(frozen=True)
class MixLengths:
    """A split of a ``Mix`` whose sources are of different kinds that share a batch layout (text, conversations,
    prompt/completion):
    each source is cut and batched by its own kind's strategy, its training rows then interleaved by
    ``mixing.MixedBatchSampler`` as the run interleaves them (``plan_mix.plan_mixed_strategy``).

    ``lengths`` are the mixed sequences as an epoch reads them (each source's taken ``times`` over: whole passes
    and a seeded part of one), the distribution the planner draws against ``max_length``.
    """

    sources: tuple[MixSource, ...]
    lengths: np.ndarray
    by: str = "tokens"
    exhausted: str = "repeat"
    seed: int = 0


def lengths_at(docs: Any, max_length: int, strategy: Any = None) -> tuple[np.ndarray, int, int | None]:
    """Documents of a split at ``max_length``: ``(lengths, tokens lost before batching, trained tokens or None)``;
    prompt/completion rows cut by ``strategy``'s limits (a ``Strategy`` at that ``max_length``); text
    ``[documents]`` and pair ``[pairs, 3]`` lengths are returned as they are."""
    if isinstance(docs, ConversationLengths):
        return docs.at(max_length)
    if isinstance(docs, PromptCompletionLengths):
        return docs.at(strategy.prompt_completion_limits)
    return np.asarray(docs, dtype=np.int64), 0, None


def whole_lengths(docs: Any) -> np.ndarray:
    """The lengths before any cut: a conversation's whole token count, a mix's sequences as its epoch reads them,
    else the lengths given."""
    whole = isinstance(docs, (ConversationLengths, PromptCompletionLengths, MixLengths))
    return docs.lengths if whole else np.asarray(docs)


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
    from lightning_seqmem.streams.reading import is_stream

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


def column_lengths(dm: Any, split: str = "train") -> dict[str, np.ndarray]:
    """Non-empty token counts of one split per part: ``documents`` for text, ``prompt`` and ``completion`` for
    prompt/completion data (what the length histogram draws, one panel each)."""
    return _split_lengths(dm)[split]


def _split_lengths(dm: Any) -> dict[str, dict[str, np.ndarray]]:
    """``{split: {part: token counts}}`` of the documents the DataModule's split pipeline keeps (non-empty, the
    validation split carved out as ``setup`` carves it); a part's empty entries are left out too."""
    tokenized, kind = dm.tokenized_documents()
    documents = split_documents(tokenized, kind, dm.settings.batching.seed)
    return {
        split: {part: source.lengths[source.lengths > 0] for part, source in docs.parts.items()}
        for split, docs in documents.items()
    }


__all__ = ["MixLengths", "MixSource", "column_lengths", "lengths_at", "stream_sample", "whole_lengths"]
