"""Truncation that respects turns: a conversation longer than ``max_length`` loses whole oldest turns first.

Pure functions on the per-turn token ends and trained spans of an
:class:`~lightning_seqmem.data.conversations.EncodedConversation`; every dropped token is counted. A fragment of
a conversation is never kept without its start (preamble and system message), so what is trained always has the
context the template gives it.
"""

from __future__ import annotations

import numpy as np

from lightning_seqmem.data.conversations import EncodedConversation, merge_spans


def truncate_turns(
    turn_ends: np.ndarray, label_spans: np.ndarray, keep_turns: int, max_length: int | None
) -> tuple[np.ndarray, int]:
    """Which token ranges of a conversation to keep under ``max_length``: whole turns, oldest dropped first.

    The first ``keep_turns`` turns (preamble, system message) stay. Turns after the last trained one carry no loss
    and go first; then the oldest other turns, one at a time, until the rest fits. If the last trained turn alone is
    still too long, it keeps its start. When even the kept turns fill ``max_length`` the result may hold no
    trained token: the caller flags it (``on_empty_labels``).

    Args:
        turn_ends: ``[turns]`` token end of each turn.
        label_spans: ``[spans, 2]`` trained token ranges.
        keep_turns: leading turns never dropped.
        max_length: the limit; ``None`` for none.

    Returns:
        ``(ranges, dropped)``: ``[k, 2]`` int64 ``[start, end)`` ranges in order, their total ``<= max_length``, and
        the number of tokens dropped (every token counted).

    Example::

        >>> r, d = truncate_turns(np.array([2, 5, 9, 12]), np.array([[5, 9]]), 1, 8)
        >>> r.tolist(), d
        ([[0, 2], [5, 9]], 5)
    """
    ends = np.asarray(turn_ends, dtype=np.int64)
    total = int(ends[-1]) if len(ends) else 0
    if max_length is None or total <= max_length:
        return np.array([[0, total]], dtype=np.int64), 0
    starts = np.concatenate([[0], ends[:-1]])
    spans = np.asarray(label_spans, dtype=np.int64).reshape(-1, 2)
    trained = [t for t in range(len(ends)) if ((spans[:, 0] < ends[t]) & (spans[:, 1] > starts[t])).any()]
    head_end = int(ends[keep_turns - 1]) if keep_turns else 0
    last = trained[-1] if trained else -1
    if last < keep_turns or head_end >= max_length:  # nothing trained beyond the kept turns: keep the start
        return np.array([[0, max_length]], dtype=np.int64), total - max_length
    first = keep_turns
    while first < last and head_end + int(ends[last] - starts[first]) > max_length:
        first += 1
    tail_start = int(starts[first])
    tail_end = min(int(ends[last]), tail_start + max_length - head_end)
    ranges = [[0, head_end]] if head_end else []
    if ranges and ranges[-1][1] == tail_start:
        ranges[-1][1] = tail_end
    else:
        ranges.append([tail_start, tail_end])
    kept = sum(end - start for start, end in ranges)
    return np.array(ranges, dtype=np.int64), total - kept


def truncate(conversation: EncodedConversation, max_length: int | None) -> EncodedConversation:
    """The conversation cut by :func:`truncate_turns`, its spans and turn ends moved to the kept tokens."""
    ranges, dropped = truncate_turns(
        conversation.turn_ends, conversation.label_spans, conversation.keep_turns, max_length
    )
    if dropped == 0:
        return conversation
    pieces, spans, turn_ends, offset = [], [], [], 0
    for start, end in ranges:
        pieces.append(conversation.input_ids[start:end])
        for s, e in conversation.label_spans:
            if e > start and s < end:
                spans.append((max(s, start) - start + offset, min(e, end) - start + offset))
        for t in conversation.turn_ends:
            if start < t <= end:
                turn_ends.append(t - start + offset)
        offset += end - start
        if not turn_ends or turn_ends[-1] != offset:  # a turn cut short ends where the kept tokens end
            turn_ends.append(offset)
    return EncodedConversation(
        input_ids=np.concatenate(pieces).astype(np.int32),
        label_spans=merge_spans(spans),
        turn_ends=np.asarray(turn_ends, dtype=np.int32),
        keep_turns=min(conversation.keep_turns, len(turn_ends)),
        num_truncated=conversation.num_truncated + dropped,
    )
