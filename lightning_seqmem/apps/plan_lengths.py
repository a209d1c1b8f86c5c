"""What the planner plans on, per split: document lengths, or conversations cut per candidate ``max_length``.

Text lengths do not depend on ``max_length``; a conversation's rows do (whole oldest turns dropped, those left with
no trained token handled by ``on_empty_labels``), so :class:`Conversations` cuts them per candidate the way
``SeqMemDataModule.setup`` does (``batching.conversation_rows``). No Lightning import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Conversations:
    """A split of conversations for the planner (its cached conversation columns)."""

    dataset: Any  # the split's cached conversation columns
    on_empty_labels: str = "drop"

    @property
    def lengths(self) -> np.ndarray:
        """``[conversations]`` whole token counts."""
        from lightning_seqmem.data.tokens import view_of_dataset

        return view_of_dataset(self.dataset, "input_ids").lengths

    def at(self, max_length: int) -> tuple[np.ndarray, int, int]:
        """``(row lengths, tokens lost, trained tokens)`` at ``max_length``."""
        from lightning_seqmem.batching.conversation_rows import conversation_rows

        rows = conversation_rows(self.dataset, max_length, self.on_empty_labels)
        return (
            rows.source.lengths,
            rows.stats["tokens_truncated"] + rows.stats["tokens_dropped"],
            rows.stats["trained_tokens"],
        )


def lengths_at(docs: Any, max_length: int) -> tuple[np.ndarray, int, int | None]:
    """Documents of a split at ``max_length``: ``(lengths, tokens lost before batching, trained tokens or None)``;
    text ``[documents]`` and pair ``[pairs, 3]`` lengths are returned as they are."""
    if isinstance(docs, Conversations):
        return docs.at(max_length)
    return np.asarray(docs, dtype=np.int64), 0, None


def whole_lengths(docs: Any) -> np.ndarray:
    """The lengths before any cut: a conversation's whole token count, else the lengths given."""
    return docs.lengths if isinstance(docs, Conversations) else np.asarray(docs)


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


__all__ = ["Conversations", "lengths_at", "stream_sample", "whole_lengths"]
