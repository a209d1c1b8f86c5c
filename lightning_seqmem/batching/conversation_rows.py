"""Conversations to rows: truncation by whole turns, conversations with nothing to learn dropped, lazy labels.

Pure functions on the cached Arrow columns of conversations (``input_ids``, ``label_spans``, ``turn_ends``,
``keep_turns``, ``num_trained``, written by ``data.conversations.encode_rows``), read as numpy views: no token is
copied here. Every conversation comes out at most ``max_length`` tokens long (whole oldest turns dropped first,
``data.chat_truncation.truncate_turns``), so the strategies never split one; its labels are a token source
(:class:`SpanLabels`) built when a row is served from the trained spans, so labels are never stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_seqmem.batch import IGNORE_INDEX
from lightning_seqmem.data.chat_truncation import truncate_turns
from lightning_seqmem.data.conversations import select_trained
from lightning_seqmem.data.tokens import ConcatView, TokenView, _SourceMixin, dataset_indices, view_of_dataset

CONVERSATION_COLUMNS = ("input_ids", "label_spans", "turn_ends", "keep_turns", "num_trained")
"""The cached columns of conversations (``data.encode.token_features("conversations")``)."""


class SpanLabels(_SourceMixin):
    """Labels of conversations as a token source: document ``i``'s token where a trained span covers it, else -100.

    Args:
        ids: ``TokenView`` of the conversations' ``input_ids``.
        spans: ``TokenView`` of the flattened ``[s0, e0, s1, e1, ...]`` trained spans of each conversation.
        offset: ``[docs]`` first token of each document in its conversation (0 unless trimmed).
        lengths: ``[docs]`` tokens per document (the conversation's length unless trimmed).
    """

    dtype = np.dtype(np.int64)

    def __init__(
        self, ids: TokenView, spans: TokenView, offset: np.ndarray | None = None, lengths: np.ndarray | None = None
    ) -> None:
        self.ids, self.spans = ids, spans
        self.offset = np.zeros(len(ids.lengths), np.int64) if offset is None else np.asarray(offset, np.int64)
        self.lengths = ids.lengths.copy() if lengths is None else np.asarray(lengths, np.int64)

    def select(self, docs: np.ndarray) -> SpanLabels:
        docs = np.asarray(docs, dtype=np.int64)
        return SpanLabels(self.ids.select(docs), self.spans.select(docs), self.offset[docs], self.lengths[docs])

    def trim(self, offset: np.ndarray, length: np.ndarray) -> SpanLabels:
        """Every document cut to ``[offset, offset + length)`` of itself (per-document arrays)."""
        return SpanLabels(self.ids, self.spans, self.offset + np.asarray(offset, np.int64), length)

    def pieces(self, doc: np.ndarray, start: np.ndarray, length: np.ndarray) -> list[np.ndarray]:
        doc = np.asarray(doc, dtype=np.int64)
        first = self.offset[doc] + np.asarray(start, dtype=np.int64)
        tokens = self.ids.pieces(doc, first, length)
        spans = self.spans.pieces(doc, np.zeros(doc.size, np.int64), self.spans.lengths[doc])
        out = []
        for token, span, lo in zip(tokens, spans, first.tolist()):
            labels = np.full(len(token), IGNORE_INDEX, dtype=np.int64)
            for s, e in np.asarray(span).reshape(-1, 2).tolist():
                a, b = max(s - lo, 0), min(e - lo, len(token))
                if b > a:
                    labels[a:b] = token[a:b]
            out.append(labels)
        return out


@dataclass
class ConversationRows:
    """A split's conversations after truncation by turns and ``on_empty_labels``: what the strategies get."""

    keep: np.ndarray  # [kept] positions of the conversations trained on
    source: Any  # token source of the kept conversations (each <= max_length)
    labels: Any  # their labels (``SpanLabels``, trimmed like the tokens)
    stats: dict[str, int]


def conversation_rows(ds: Any, max_length: int, on_empty_labels: str = "drop") -> ConversationRows:
    """Truncate the conversations of ``ds`` (cached columns, see :data:`CONVERSATION_COLUMNS`) by whole turns to
    ``max_length``, then keep those with a trained token left (``data.conversations.select_trained``).

    Only conversations over ``max_length`` are visited one by one (``truncate_turns`` on their turn ends); the kept
    tokens of each are at most two ranges (the start it never drops, then its newest turns), so every document is
    two trimmed views back to back (the first starts at 0 unless no turn is kept whole at the start).

    Returns:
        :class:`ConversationRows`; its ``stats``: ``tokens_truncated`` (turns dropped or cut),
        ``conversations_dropped_empty`` and ``tokens_dropped`` (their tokens), ``trained_tokens``.

    Raises:
        ValueError: ``on_empty_labels="error"`` and a conversation has no trained token left (names its row).
    """
    ids, spans = view_of_dataset(ds, "input_ids"), view_of_dataset(ds, "label_spans")
    turn_ends = view_of_dataset(ds, "turn_ends")
    lengths = ids.lengths
    # Kept tokens: [head_start, head_start + head) then [tail_start, tail_start + tail_len); untruncated: all.
    head_start, head = np.zeros_like(lengths), np.minimum(lengths, max_length)
    tail_start, tail_len = np.zeros_like(lengths), np.zeros_like(lengths)
    trained = _column(ds, "num_trained")
    long = np.flatnonzero(lengths > max_length)
    if len(long):
        keep_turns = _column(ds, "keep_turns")
        trained = trained.copy()
        for i in long.tolist():
            doc_spans = spans.row(i).reshape(-1, 2)
            ranges, _ = truncate_turns(turn_ends.row(i), doc_spans, int(keep_turns[i]), max_length)
            (a0, a1), (b0, b1) = ranges[0], ranges[1] if len(ranges) > 1 else (ranges[0][1], ranges[0][1])
            head_start[i], head[i], tail_start[i], tail_len[i] = a0, a1 - a0, b0, b1 - b0
            trained[i] = sum(
                max(0, min(e, b) - max(s, a)) for s, e in doc_spans.tolist() for a, b in ((a0, a1), (b0, b1))
            )
    kept_tokens = head + tail_len
    keep, dropped = select_trained(trained, on_empty_labels, rows=dataset_indices(ds))
    labels = SpanLabels(ids, spans)
    source = ConcatView(ids.trim(head_start, head), ids.trim(tail_start, tail_len)).select(keep)
    labels = ConcatView(labels.trim(head_start, head), labels.trim(tail_start, tail_len)).select(keep)
    emptied = np.setdiff1d(np.arange(len(lengths)), keep)
    stats = {
        "tokens_truncated": int((lengths - kept_tokens).sum()),
        "conversations_dropped_empty": dropped,
        "tokens_dropped": int(kept_tokens[emptied].sum()),
        "trained_tokens": int(trained[keep].sum()),
    }
    return ConversationRows(keep, source, labels, stats)


@dataclass(frozen=True)
class ConversationLengths:
    """A split of conversations as the planner plans it (``kinds.Conversations.plan_lengths``): their rows depend
    on ``max_length`` (whole oldest turns dropped, those left with no trained token handled by
    ``on_empty_labels``), so :meth:`at` cuts them per candidate the way :func:`conversation_rows` cuts a split."""

    dataset: Any  # the split's cached conversation columns
    on_empty_labels: str = "drop"

    @property
    def lengths(self) -> np.ndarray:
        """``[conversations]`` whole token counts."""
        return view_of_dataset(self.dataset, "input_ids").lengths

    def at(self, max_length: int) -> tuple[np.ndarray, int, int]:
        """``(row lengths, tokens lost, trained tokens)`` at ``max_length``."""
        rows = conversation_rows(self.dataset, max_length, self.on_empty_labels)
        return (
            rows.source.lengths,
            rows.stats["tokens_truncated"] + rows.stats["tokens_dropped"],
            rows.stats["trained_tokens"],
        )


def _column(ds: Any, name: str) -> np.ndarray:
    """A scalar column of ``ds`` in its row order (its indices mapping applied), as numpy."""
    values = ds.data.column(name).to_numpy()
    indices = dataset_indices(ds)
    return (values if indices is None else values[indices]).astype(np.int64)
