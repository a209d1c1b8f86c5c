"""The split pipeline: documents -> token source -> rows -> plan -> statistics. No Lightning import.

``SeqMemDataModule.setup`` runs it for train and validation and emits the warnings it returns; ``seqmem-plan`` reads
the same documents (:func:`split_documents`) for its lengths, so both see the same non-empty documents of the same
validation split. Everything works on numpy views of the Arrow columns and on lengths: no token is copied here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_seqmem.batch import IGNORE_INDEX, REF_LOGPS_KEYS
from lightning_seqmem.batching.conversation_rows import conversation_rows
from lightning_seqmem.batching.pair_rows import plan_pairs
from lightning_seqmem.batching.pair_strategies import PREFERENCE
from lightning_seqmem.batching.strategies import EpochStats, Strategy
from lightning_seqmem.batching.truncation import prompt_completion_spans
from lightning_seqmem.data.chat_pairs import ChatPairs, pair_form
from lightning_seqmem.data.columns import PRETOKENIZED_KINDS, check_columns
from lightning_seqmem.data.conversations import MESSAGES_COLUMN, ConversationSettings
from lightning_seqmem.data.sources import ensure_validation_split, load_text_dataset, select_rows
from lightning_seqmem.data.tokens import ConcatView, ConstantView, view_of_dataset

SPLITS = ("train", "validation")
PARTS = {
    "text": {"documents": "input_ids"},
    "prompt_completion": {"prompt": "prompt_ids", "completion": "completion_ids"},
    "conversations": {"documents": "input_ids"},
    PREFERENCE: {"prompt": "prompt_ids", "chosen": "chosen_ids", "rejected": "rejected_ids"},
}


def load_documents(
    dataset: Any,
    data: Any,
    tokenizer: Callable[[], Any],
    explicit_tokenizer: bool,
    conversation: ConversationSettings | None = None,
):
    """``(DatasetDict of token columns, kind, pretokenized)``: ``dataset`` tokenized through the tokenize-once cache,
    or pre-tokenized data as they are (their values checked once); ``kind`` is ``"text"``, ``"prompt_completion"``,
    ``"conversations"`` or ``"preference"`` (pairs; precomputed reference log-probability columns are carried along).

    Args:
        dataset: what ``SeqMemDataModule(dataset=...)`` takes.
        data: the ``DataSettings`` (text column, cache folder, tokenization processes).
        tokenizer: gives the tokenizer when needed (loading it may be slow, and pre-tokenized data need none).
        explicit_tokenizer: the user gave one: pre-tokenized ids are checked against its vocabulary.
        conversation: how conversations become trained tokens (``train_on``, ``train_field``: part of the cache key).
    """
    from lightning_seqmem.data.token_cache import tokenize_cached
    from lightning_seqmem.data.value_checks import check_values_once

    raw = load_text_dataset(dataset)
    kind = check_columns(raw, data.text_column)
    if kind in PRETOKENIZED_KINDS:
        vocab = len(tokenizer()) if explicit_tokenizer else None
        for split, ds in raw.items():
            check_values_once(ds, kind, split, vocab, cache_dir=data.cache_dir)
        return raw, PRETOKENIZED_KINDS[kind], True
    chat = kind == "conversations"
    how = (
        (conversation or ConversationSettings())
        if chat
        else chat_pairs_of(raw["train"])
        if kind == PREFERENCE
        else None
    )
    tokenized = tokenize_cached(
        raw,
        tokenizer(),
        kind,
        MESSAGES_COLUMN if chat else data.text_column,
        num_proc=data.num_proc,
        cache_dir=data.cache_dir,
        source=dataset,
        conversation=how,
    )
    if kind == PREFERENCE:  # the token cache keeps token columns only: the reference values come from the rows
        for split, ds in raw.items():
            for key in REF_LOGPS_KEYS:
                if key in ds.column_names:
                    tokenized[split] = tokenized[split].add_column(key, ds[key])
    return tokenized, kind, False


def chat_pairs_of(train: Any) -> ChatPairs | None:
    """How conversation-form pairs are rendered (``None`` for text pairs)."""
    if pair_form(train.features) != "conversations":
        return None
    return ChatPairs(has_prompt="prompt" in train.column_names)


@dataclass(frozen=True)
class Documents:
    """A split's non-empty documents as token views, per part (``documents``; or ``prompt`` and ``completion``)."""

    dataset: Any  # the split's rows, empty documents left out (an index selection: no tokens copied)
    kind: str  # "text", "prompt_completion", "conversations" or "preference"
    parts: dict[str, Any]  # part name -> token source (``tokens.TokenSource``)
    labels: Any  # text with a ``labels`` column: its token source; else None
    empty: int  # empty documents left out

    @property
    def lengths(self) -> np.ndarray:
        """``[documents]`` token counts (prompt + completion for prompt/completion rows)."""
        return sum(source.lengths for source in self.parts.values())


def documents(ds: Any, kind: str) -> Documents:
    """The token views of ``ds``'s columns for data of ``kind``, empty documents left out."""
    parts = {name: view_of_dataset(ds, column) for name, column in PARTS[kind].items()}
    labels = view_of_dataset(ds, "labels") if kind == "text" and "labels" in ds.column_names else None
    lengths = sum(source.lengths for source in parts.values())
    # Pairs are never skipped quietly: an empty completion is an error naming the row (``plan_pairs``).
    keep = np.flatnonzero(lengths > 0) if kind != PREFERENCE else np.arange(len(lengths))
    empty = len(lengths) - len(keep)
    if empty:
        ds = select_rows(ds, keep, "non-empty")
        parts = {name: source.select(keep) for name, source in parts.items()}
        labels = labels.select(keep) if labels is not None else None
    return Documents(ds, kind, parts, labels, empty)


def split_documents(tokenized: Any, kind: str, seed: int) -> dict[str, Documents]:
    """Train and validation :class:`Documents` of a tokenized ``DatasetDict`` (validation carved out with ``seed``
    when the data have none)."""
    tokenized = ensure_validation_split(tokenized, seed=seed)
    return {split: documents(tokenized[split], kind) for split in SPLITS}


@dataclass
class PreparedSplit:
    """A split after the pipeline: what its loader serves and what ``stats()`` reports."""

    dataset: Any
    rows: Any  # the rows served (a ``Dataset`` gathering tokens on demand)
    lengths: np.ndarray  # [rows] real tokens per row fed to the model
    labels: Any  # the token source of labels, where rows carry their own
    stats: dict[str, Any]
    warnings: list[str] = field(default_factory=list)  # for ``rank_zero_warn``
    infos: list[str] = field(default_factory=list)  # for ``rank_zero_info``


def prepare_split(
    split: str,
    docs: Documents,
    strategy: Strategy,
    max_length: int,
    completion_only_loss: bool = True,
    on_empty_labels: str = "drop",
) -> PreparedSplit:
    """Truncate or pack ``docs`` with ``strategy`` and count every token that will not reach the model.

    Conversations are first cut to ``max_length`` by whole turns and those left with no trained token handled by
    ``on_empty_labels`` (``batching.conversation_rows``); their stats add ``conversations_dropped_empty``,
    ``trained_tokens`` and ``trained_share`` (trained tokens / tokens fed to the model). Preference pairs are
    planned on their own (:func:`_preference_split`)."""
    if docs.kind == PREFERENCE:
        return _preference_split(split, docs, strategy)
    lengths = docs.lengths
    if split == "train" and len(lengths) == 0:
        raise ValueError("Every training document is empty after tokenization: there is nothing to train on.")
    stats = {
        "documents": len(lengths),
        "empty_documents_skipped": docs.empty,
        "tokens": int(lengths.sum()),
        "tokens_truncated": 0,
        "tokens_dropped": 0,
        "documents_split": 0,
        "documents_over_max_length": int((lengths > max_length).sum()),
        "longest_document": int(lengths.max(initial=0)),
    }
    warnings, dataset = [], docs.dataset
    if docs.kind == "conversations":
        chat = conversation_rows(docs.dataset, max_length, on_empty_labels)
        source, labels = chat.source, chat.labels
        stats.update(chat.stats)
        if chat.stats["conversations_dropped_empty"]:
            dataset = select_rows(docs.dataset, chat.keep, "trained")
            warnings.append(
                f"{split}: {chat.stats['conversations_dropped_empty']} conversations have no trained token (no "
                "assistant turn under train_on='assistant', or truncation left none) and are dropped "
                f"({chat.stats['tokens_dropped']:,} tokens, counted in tokens_dropped). Pass on_empty_labels='error' "
                "to find them, or 'keep' to train on them without loss."
            )
    elif docs.kind == "prompt_completion":
        source, labels, emptied = _prompt_completion_rows(docs, strategy, stats, completion_only_loss)
        if emptied:
            warnings.append(
                f"{split}: {emptied} prompt/completion rows have no completion left after truncation and are "
                "skipped. Lower max_prompt_length or raise max_length to keep them."
            )
    else:
        source, labels = docs.parts["documents"], docs.labels
    planned = strategy.rows(source, labels)
    for key, value in planned.stats.items():
        stats[key] += value  # adds to any prompt/completion truncation
    stats.update(epoch_stats(strategy, planned.lengths, split).counts())
    if docs.kind == "conversations":
        stats["trained_share"] = stats["trained_tokens"] / max(int(planned.lengths.sum()), 1)
    warnings += _lost_tokens(split, stats, strategy, max_length, docs.kind)
    infos = [f"[lightning_seqmem] {split}: skipped {docs.empty} empty documents."] if docs.empty else []
    return PreparedSplit(dataset, planned.rows, planned.lengths, labels, stats, warnings, infos)


def _preference_split(split: str, docs: Documents, strategy: Strategy) -> PreparedSplit:
    """Pairs checked and planned on lengths (``pair_rows.plan_pairs``: TRL's two truncation stages, identical
    completions, pairs that lost a completion left out), then batched by the split's pair strategy; every token
    that will not reach the model counted (a pair's prompt counts once per sequence: both rows carry it)."""
    prompt, chosen, rejected = (docs.parts[name] for name in ("prompt", "chosen", "rejected"))
    if split == "train" and len(prompt) == 0:
        raise ValueError("The training split holds no preference pairs: there is nothing to train on.")
    ref = {
        key: np.asarray(docs.dataset[key], dtype=np.float64)
        for key in REF_LOGPS_KEYS
        if key in docs.dataset.column_names
    }
    try:
        source, spans, warnings = plan_pairs(prompt, chosen, rejected, ref, strategy.pair_limits)
    except ValueError as error:
        raise ValueError(f"Preference data, split {split!r}: {error}") from None
    sequences = prompt.lengths + np.stack([chosen.lengths, rejected.lengths])  # [2, pairs] before truncation
    counts = spans.dropped()
    stats = {
        "documents": len(prompt),
        "empty_documents_skipped": 0,
        "tokens": int(sequences.sum()),
        **counts,
        "tokens_dropped": int(spans.sequence_lengths[:, spans.lost].sum()),
        "documents_split": 0,
        "documents_over_max_length": int((sequences > strategy.settings.max_length).any(axis=0).sum()),
        "longest_document": int(sequences.max(initial=0)),
    }
    planned = strategy.rows(source)
    stats.update(epoch_stats(strategy, planned.lengths, split).counts())
    warnings = [f"{split}: {message}" for message in warnings]
    warnings += _lost_tokens(split, stats, strategy, strategy.settings.max_length)
    return PreparedSplit(docs.dataset, planned.rows, planned.lengths, None, stats, warnings)


def epoch_stats(strategy: Strategy, lengths: np.ndarray, split: str) -> EpochStats:
    """Epoch 0 of ``split`` on one process, rows of ``[rows]`` real tokens (``strategies.EpochStats``)."""
    return strategy.epoch_stats(lengths, strategy.split_sampler(lengths, split, num_replicas=1, rank=0))


def _prompt_completion_rows(docs: Documents, strategy: Strategy, stats: dict, completion_only_loss: bool):
    """Truncate prompt/completion pairs once, at dataset level and on lengths, so every cut token is counted
    exactly; rows are views (the kept part of the prompt, then of the completion), gathered when served.
    Returns ``(source, labels, rows left without a completion)``."""
    prompt, completion = docs.parts["prompt"], docs.parts["completion"]
    p_off, p_keep, c_keep = prompt_completion_spans(
        prompt.lengths, completion.lengths, strategy.prompt_completion_limits
    )
    truncated = int((prompt.lengths + completion.lengths - p_keep - c_keep).sum())
    kept = np.flatnonzero(c_keep > 0)
    emptied = len(c_keep) - len(kept)  # nothing to learn from: reported, never trained on silently
    truncated += int((p_keep[c_keep == 0]).sum())
    prompt = prompt.trim(p_off, p_keep).select(kept)
    completion = completion.trim(np.zeros_like(c_keep), c_keep).select(kept)
    source = ConcatView(prompt, completion)
    labels = ConcatView(ConstantView(IGNORE_INDEX, prompt.lengths) if completion_only_loss else prompt, completion)
    stats.update(tokens_truncated=truncated, rows_without_completion=emptied)
    return source, labels, emptied


def _lost_tokens(split: str, stats: dict, strategy: Strategy, max_length: int, kind: str = "text") -> list[str]:
    """The warning for tokens that never reach the model, with the strategy's own fix."""
    truncated, dropped = stats["tokens_truncated"], stats["tokens_dropped"]
    if not truncated + dropped:
        return []
    fix = (
        "Conversations lose whole oldest turns first (the system message stays); raise max_length to keep them."
        if kind == "conversations"
        else strategy.lost_tokens_fix("rows_without_completion" in stats)
    )
    return [
        f"{split}: {stats['documents_over_max_length']} documents are longer than max_length={max_length}; "
        f"with strategy={strategy.name!r}, {truncated + dropped:,} of {stats['tokens']:,} tokens "
        f"({100 * (truncated + dropped) / max(stats['tokens'], 1):.2f}%) never reach the model "
        f"({truncated:,} truncated, {dropped:,} dropped). {fix}"
    ]
