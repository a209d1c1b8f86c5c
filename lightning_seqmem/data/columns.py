"""What kind of data a dataset holds (its columns), and checks of pre-tokenized ids against a vocabulary."""

from __future__ import annotations

import numpy as np

PRETOKENIZED_KINDS = {
    "tokens": "text",
    "prompt_completion_tokens": "prompt_completion",
    "preference_tokens": "preference",
}
"""Pre-tokenized kinds and the rows they give: ``input_ids`` [+ ``labels``]; ``prompt_ids`` + ``completion_ids``;
``prompt_ids`` + ``chosen_ids`` + ``rejected_ids``."""

PREFERENCE_TEXT = ("prompt", "chosen", "rejected")
"""Text columns of preference pairs (TRL's names); the prompt is shared by both sequences of a pair."""

PREFERENCE_IDS = ("prompt_ids", "chosen_ids", "rejected_ids")
"""Token columns of preference pairs (TRL's names)."""

ID_COLUMNS = {
    "tokens": ("input_ids", "labels"),
    "prompt_completion_tokens": ("prompt_ids", "completion_ids"),
    "preference_tokens": PREFERENCE_IDS,
}


def check_columns(
    dsd, text_column: str = "text", prompt_column: str = "prompt", completion_column: str = "completion"
) -> str:
    """Which kind of data this is: ``"text"``, ``"prompt_completion"``, ``"conversations"`` (a ``messages``
    column of turns), or pre-tokenized ``"tokens"`` (``input_ids``, optionally ``labels``) or
    ``"prompt_completion_tokens"`` (``prompt_ids``, ``completion_ids``); preference pairs: ``"preference"``
    (``prompt``, ``chosen``, ``rejected`` text) or ``"preference_tokens"`` (``prompt_ids``, ``chosen_ids``,
    ``rejected_ids``). Token columns win over text columns: a dataset that carries its tokens is used as it is.

    Raises:
        ValueError: none of these columns exist (the message lists what does), or ``messages`` next to a text or
            prompt/completion column.
    """
    from lightning_seqmem.data.conversations import check_conversation_columns

    columns = set(dsd["train"].column_names)
    if "input_ids" in columns:
        return "tokens"
    if {"chosen_ids", "rejected_ids"} & columns or {"chosen", "rejected"} & columns:
        return _preference_kind(columns, dsd["train"].features)
    if {"prompt_ids", "completion_ids"} <= columns:
        return "prompt_completion_tokens"
    if check_conversation_columns(columns, other_columns=(text_column, prompt_column, completion_column)):
        return "conversations"
    if text_column in columns:
        return "text"
    if {prompt_column, completion_column} <= columns:
        return "prompt_completion"
    raise ValueError(
        f"The dataset has no usable column: expected {text_column!r} (plain text), {prompt_column!r} and "
        f"{completion_column!r} (prompt/completion), 'messages' (conversations), or token ids ('input_ids', or 'prompt_ids' and "
        f"'completion_ids'); it has {sorted(columns)}. Pass text_column=<name> to SeqMemDataModule, or rename a "
        "column with dataset.rename_column()."
    )


def _preference_kind(columns: set[str], features=None) -> str:
    """``"preference_tokens"`` or ``"preference"``: a dataset with ``chosen``/``rejected`` columns (text or ids) must
    have all three of TRL's columns of one form. A missing ``prompt`` is refused for text (say ``prompt=""``
    explicitly) and allowed for conversations, whose shared leading turns are then the prompt."""
    from lightning_seqmem.data.chat_pairs import pair_form

    for kind, names in (("preference_tokens", PREFERENCE_IDS), ("preference", PREFERENCE_TEXT)):
        if set(names) <= columns:
            return kind
    chat = features is not None and {"chosen", "rejected"} <= columns and pair_form(features) == "conversations"
    if chat and "prompt_ids" not in columns:
        return "preference"
    have = sorted(columns & set(PREFERENCE_TEXT + PREFERENCE_IDS))
    raise ValueError(
        f"Preference data need the columns {list(PREFERENCE_TEXT)} (text or conversations; conversations may leave "
        f"out 'prompt': their shared leading turns are the prompt) or {list(PREFERENCE_IDS)} (token ids); "
        f"the dataset has {have} of them (all columns: {sorted(columns)}). Add the missing column (a pair without a "
        "prompt: an empty string), or rename one with dataset.rename_column()."
    )


def id_columns(kind: str) -> tuple[str, ...]:
    """The token-id columns of a pre-tokenized kind (``"tokens"``, ``"prompt_completion_tokens"`` or
    ``"preference_tokens"``) whose values ``check_token_values`` checks; ``labels`` may be missing from a dataset."""
    return ID_COLUMNS[kind]


def check_token_values(ds, kind: str, split: str, vocab_size: int | None = None) -> None:
    """Pre-tokenized data: every token id an integer in ``[0, vocab_size)`` (labels may also be -100).

    Vectorised: a min/max per Arrow chunk, and only where that fails, the offending row (``searchsorted``).

    Raises:
        ValueError: a non-integer column, or an out-of-range id; the message names the split, column and row.
    """
    import pyarrow as pa

    from lightning_seqmem.batch import IGNORE_INDEX
    from lightning_seqmem.data.tokens import dataset_indices, view_of_arrow

    indices = dataset_indices(ds)
    for column in id_columns(kind):
        if column not in ds.column_names:
            continue
        arrow = ds.data.column(column)
        value_type = getattr(arrow.type, "value_type", None)
        if value_type is None or not pa.types.is_integer(value_type):
            raise ValueError(
                f"Split {split!r}, column {column!r} holds {value_type or arrow.type} values: token ids must be lists "
                "of integers (row 0 onward). "
                f"Cast it (dataset.cast_column({column!r}, datasets.List(datasets.Value('int32')))) or tokenize again."
            )
        view = view_of_arrow(arrow)  # table rows, in order: starts are sorted
        for chunk, base in zip(view.chunks, view.chunk_base[:-1].tolist()):
            if not chunk.size:
                continue
            lo, hi = int(chunk.min()), int(chunk.max())
            if lo >= 0 and (vocab_size is None or hi < vocab_size):
                continue
            bad = chunk < 0
            if column == "labels":
                bad &= chunk != IGNORE_INDEX  # the ignored label is the one negative value allowed
            if vocab_size is not None:
                bad |= chunk >= vocab_size
            rows = np.unique(np.searchsorted(view.starts, base + np.flatnonzero(bad), side="right") - 1)
            if indices is not None:  # table rows to the dataset's rows (rows it does not select are not ours)
                rows = np.flatnonzero(np.isin(indices, rows))
            if rows.size:
                limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise ValueError(
                    f"Row {int(rows[0])} of split {split!r}, column {column!r} holds a token id outside {limit}"
                    f"{' (or -100)' if column == 'labels' else ''} ({rows.size} such rows). Token ids must index the "
                    "tokenizer's vocabulary: re-tokenize with the tokenizer you pass, or pass the one used."
                )
