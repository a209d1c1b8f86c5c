"""Which kind of data a dataset or a stream holds, from its columns: the one rule for both read modes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lightning_seqmem.data.columns import PREFERENCE_IDS, PREFERENCE_TEXT
from lightning_seqmem.kinds.base import Kind
from lightning_seqmem.kinds.conversations import Conversations
from lightning_seqmem.kinds.preference import Preference
from lightning_seqmem.kinds.prompt_completion import PromptCompletion
from lightning_seqmem.kinds.text import Text

STREAM_KINDS = (Text(), Conversations(), PromptCompletion(), Text(True), PromptCompletion(True))
"""What a stream may hold (``Kind.streams``): text, conversations (``messages``), prompt/completion text, token ids
(``input_ids`` [+ ``labels``], or ``prompt_ids`` and ``completion_ids``)."""


def detect(columns: Iterable[str], features: Mapping[str, Any] | None = None, text_column: str = "text") -> Kind:
    """The kind of data with these columns: text (``text_column``), prompt/completion (``prompt``,
    ``completion``), conversations (``messages``), preference pairs (``prompt``, ``chosen``, ``rejected``: text or
    turns, ``features`` tell which), or the pre-tokenized forms (``input_ids`` [+ ``labels``]; ``prompt_ids`` and
    ``completion_ids``; ``prompt_ids``, ``chosen_ids`` and ``rejected_ids``). Token columns win over text columns:
    a dataset that carries its tokens is used as it is.

    Raises:
        ValueError: none of these columns exist (the message lists what does), a preference column is missing, or
            ``messages`` next to a text or prompt/completion column.
    """
    from lightning_seqmem.data.chat_checks import check_conversation_columns

    columns = set(columns)
    if "input_ids" in columns:
        return Text(pretokenized=True)
    if {"chosen_ids", "rejected_ids"} & columns or {"chosen", "rejected"} & columns:
        return _preference(columns, features)
    if {"prompt_ids", "completion_ids"} <= columns:
        return PromptCompletion(pretokenized=True)
    if check_conversation_columns(columns, other_columns=(text_column, "prompt", "completion")):
        return Conversations()
    if text_column in columns:
        return Text()
    if {"prompt", "completion"} <= columns:
        return PromptCompletion()
    raise ValueError(
        f"The dataset has no usable column: expected {text_column!r} (plain text), 'prompt' and "
        "'completion' (prompt/completion), 'messages' (conversations), or token ids ('input_ids', or 'prompt_ids' "
        f"and 'completion_ids'); it has {sorted(columns)}. Pass text_column=<name> to SeqMemDataModule, or rename a "
        "column with dataset.rename_column()."
    )


def _preference(columns: set[str], features: Mapping[str, Any] | None) -> Preference:
    """A dataset with ``chosen``/``rejected`` columns (text or ids) must have all three of TRL's columns of one
    form. A missing ``prompt`` is refused for text (say ``prompt=""`` explicitly) and allowed for conversations,
    whose shared leading turns are then the prompt."""
    from lightning_seqmem.data.chat_pairs import ChatPairs, pair_form

    if set(PREFERENCE_IDS) <= columns:
        return Preference(pretokenized=True)
    chat = features is not None and {"chosen", "rejected"} <= columns and pair_form(features) == "conversations"
    if set(PREFERENCE_TEXT) <= columns or (chat and "prompt_ids" not in columns):
        return Preference(chat=ChatPairs(has_prompt="prompt" in columns) if chat else None)
    have = sorted(columns & set(PREFERENCE_TEXT + PREFERENCE_IDS))
    raise ValueError(
        f"Preference data need the columns {list(PREFERENCE_TEXT)} (text or conversations; conversations may leave "
        f"out 'prompt': their shared leading turns are the prompt) or {list(PREFERENCE_IDS)} (token ids); "
        f"the dataset has {have} of them (all columns: {sorted(columns)}). Add the missing column (a pair without a "
        "prompt: an empty string), or rename one with dataset.rename_column()."
    )


def detect_dataset(dsd: Any, text_column: str = "text") -> Kind:
    """The kind of a ``DatasetDict`` (its train split's columns decide)."""
    return detect(dsd["train"].column_names, dsd["train"].features, text_column)


def detect_stream(stream: Any, text_column: str = "text") -> Kind:
    """The kind of a stream (``IterableDataset``/``IterableDatasetDict``), from its features, else its first row.

    Raises:
        ValueError: preference pairs, which need the whole split (they are planned over it): the message says to
            load without ``streaming=True``; or no usable column.
    """
    train = stream["train"] if isinstance(stream, dict) else stream
    features = getattr(train, "features", None)
    columns = list(features) if features else list(next(iter(train.take(1)), {}))
    kind = detect(columns, features, text_column)
    if not kind.streams:
        raise ValueError(
            f"A stream of {kind.column_kind.replace('_', ' ')} (columns {sorted(columns)}) cannot be served on the "
            "fly: preference pairs are planned and batched over the whole split. Load the dataset without "
            "streaming=True (the token cache tokenizes it once per node and memory-maps the tokens, so memory "
            "stays bounded). Streams of text, conversations ('messages'), prompt/completion text or token ids "
            "('input_ids', or 'prompt_ids' and 'completion_ids') are packed on the fly."
        )
    return kind
