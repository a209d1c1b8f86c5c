"""Conversations (a ``messages`` column of ``{"role", "content"}`` turns): rendered with the tokenizer's chat
template, trained on the spans ``train_on``/``train_field`` choose (``data.conversations``), cut by whole oldest
turns to ``max_length`` (``data.chat_truncation``); one left with no trained token is dropped, kept or refused by
``on_empty_labels``. Never split by packing."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from lightning_seqmem.batching.conversation_rows import ConversationLengths, conversation_rows
from lightning_seqmem.batching.settings import SPLITS
from lightning_seqmem.batching.strategies import Strategy
from lightning_seqmem.data.chat_checks import MESSAGES_COLUMN
from lightning_seqmem.data.conversations import ConversationSettings
from lightning_seqmem.data.sources import select_rows
from lightning_seqmem.kinds.base import Documents, Kind, SplitRows, count_document


class Conversations(Kind):
    """Chat data, the trained spans per turn carried with the tokens."""

    name = "conversations"
    parts = {"documents": "input_ids"}
    stats_keys = ("conversations_dropped_empty", "trained_tokens")
    trains_whole = True
    default_overflow = "truncate"

    def source_columns(self, text_column: str = "text") -> list[str]:
        return [MESSAGES_COLUMN]

    def cache_key(self, tokenizer: Any, conversation: Any = None) -> list[str]:
        return (conversation or ConversationSettings()).cache_key(tokenizer)

    def text_encoder(self, tokenizer: Any, text_column: str, conversation: Any):
        from lightning_seqmem.data.encode import conversation_function

        return conversation_function(tokenizer, MESSAGES_COLUMN, conversation or ConversationSettings())

    def features(self):
        from lightning_seqmem.data.encode import conversation_features

        return conversation_features()

    def split_rows(self, split: str, docs: Documents, strategy: Strategy, settings: Any) -> SplitRows:
        """Cut to ``max_length`` by whole turns; those with no trained token handled by ``on_empty_labels``
        (``batching.conversation_rows``)."""
        on_empty = settings.conversation.on_empty_labels
        chat = conversation_rows(docs.dataset, settings.batching.max_length, on_empty)
        dataset, warnings = docs.dataset, []
        if chat.stats["conversations_dropped_empty"]:
            dataset = select_rows(docs.dataset, chat.keep, "trained")
            warnings.append(
                f"{split}: {chat.stats['conversations_dropped_empty']} conversations have no trained token (no "
                "assistant turn under train_on='assistant', or truncation left none) and are dropped "
                f"({chat.stats['tokens_dropped']:,} tokens, counted in tokens_dropped). Pass on_empty_labels='error' "
                "to find them, or 'keep' to train on them without loss."
            )
        return SplitRows(chat.source, chat.labels, dataset, dict(chat.stats), warnings)

    def check(self, batching: Any) -> None:
        """Packed whole only: ``Pack(method='wrapped')`` is refused."""
        if any(b.packs and b.method == "wrapped" for b in map(batching.batching_for, SPLITS)):
            raise ValueError(
                "Pack(method='wrapped') cuts rows at max_length wherever a conversation ends, and a piece of a "
                "conversation without its start would be trained on without its context. Use Pack(method='bfd') "
                "(conversations packed whole)."
            )

    def signature(self, settings: Any) -> dict[str, Any]:
        return dict(super().signature(settings), **vars(settings.conversation))  # which tokens train

    def plan_lengths(self, docs: Documents, settings: Any) -> ConversationLengths:
        """Cut per candidate ``max_length`` by the planner, as :meth:`split_rows` cuts them."""
        return ConversationLengths(docs.dataset, settings.conversation.on_empty_labels)

    def tokenizer_stats(self, tokenizer: Callable[[], Any]) -> dict[str, Any]:
        from lightning_seqmem.data.chat_template import chat_template_of, mask_method

        return {"mask_method": mask_method(chat_template_of(tokenizer()))}  # how trained spans were found

    def finish_stats(self, stats: dict[str, Any], row_lengths: np.ndarray) -> None:
        stats["trained_share"] = stats["trained_tokens"] / max(int(row_lengths.sum()), 1)

    def lost_tokens_fix(self, strategy: Strategy) -> str:
        return (
            "Conversations lose whole oldest turns first (the system message stays, with the first user turn where "
            "the template folds it in); raise max_length to keep them."
        )

    def stream_row(self, row: dict, index: Any, settings: Any, strategy: Strategy, counts: Counter):
        from lightning_seqmem.data.chat_truncation import truncate
        from lightning_seqmem.data.conversations import EncodedConversation, select_trained

        full = EncodedConversation.from_row(row)
        if not len(full.input_ids):
            counts["empty_documents_skipped"] += 1
            return []
        max_length = strategy.settings.max_length
        conversation = truncate(full, max_length)
        count_document(counts, len(full.input_ids))
        counts["documents_over_max_length"] += len(full.input_ids) > max_length
        counts["tokens_truncated"] += len(full.input_ids) - len(conversation.input_ids)
        kept, _ = select_trained([conversation.num_trained], settings.conversation.on_empty_labels, rows=[index])
        if not len(kept):
            counts["conversations_dropped_empty"] += 1
            counts["tokens_dropped"] += len(conversation.input_ids)
            return []
        counts["trained_tokens"] += conversation.num_trained
        return {"input_ids": conversation.input_ids.tolist(), "labels": conversation.labels().tolist()}
