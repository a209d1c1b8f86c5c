"""Conversation checks: a ``messages`` row is a list of ``{"role", "content"}`` turns with a known role, and a
dataset with ``messages`` has no other column to train on."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from lightning_seqmem.messages import short_repr

ROLES = ("system", "user", "assistant", "tool")
MESSAGES_COLUMN = "messages"
DEFAULT_TRAIN_FIELD = "train"
"""Per-message boolean that overrides ``train_on`` for that one turn."""


def check_conversation(messages, row, train_field: str | None = DEFAULT_TRAIN_FIELD) -> None:
    """A conversation is a non-empty list of ``{"role", "content"}`` turns with a known role.

    Args:
        messages: the turns of one conversation.
        row: what names the conversation in errors (its row index).
        train_field: the per-message override field; when present it must be a boolean.

    Raises:
        ValueError: an empty conversation, a turn that is not a mapping, without ``role`` or ``content``, with an
            unknown role or a non-boolean override; the message names the row and the turn.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or len(messages) == 0:
        raise ValueError(
            f"Conversation {row} is empty or not a list of turns ({short_repr(messages)}): each 'messages' row must "
            "be a list of {'role': ..., 'content': ...} dicts; remove empty conversations from the data."
        )
    for turn, message in enumerate(messages):
        where = f"Conversation {row}, turn {turn}"
        if not isinstance(message, Mapping):
            raise ValueError(f"{where} is {short_repr(message)}, not a {{'role', 'content'}} dict.")
        # Arrow gives every turn of a column every key, a missing one as None: None counts as missing.
        missing = [key for key in ("role", "content") if message.get(key) is None]
        # An assistant turn that only calls tools may carry content=None (OpenAI's format).
        if missing and not (missing == ["content"] and message.get("tool_calls")):
            keys = sorted(k for k in message if message[k] is not None)
            raise ValueError(
                f"{where} has no {' or '.join(repr(k) for k in missing)} (keys: {keys}): every turn needs "
                "'role' and 'content'; rename the keys (e.g. 'from'/'value' -> 'role'/'content') before passing it."
            )
        if message["role"] not in ROLES:
            raise ValueError(
                f"{where} has role {short_repr(message['role'])}; use one of {ROLES} (map e.g. 'human' -> 'user', "
                "'gpt' -> 'assistant')."
            )
        flag = message.get(train_field) if train_field else None
        if flag is not None and not isinstance(flag, (bool, np.bool_)):
            raise ValueError(f"{where}: {train_field!r} is {short_repr(flag)}; it must be true, false or absent.")


def check_conversation_columns(
    columns: Iterable[str],
    messages_column: str = MESSAGES_COLUMN,
    other_columns: Sequence[str] = ("text", "prompt", "completion"),
) -> bool:
    """Whether the data is conversations (it has ``messages_column``).

    Raises:
        ValueError: ``messages`` next to a text or prompt/completion column: which one to train on is ambiguous.
    """
    columns = set(columns)
    if messages_column not in columns:
        return False
    clash = sorted(columns & set(other_columns))
    if clash:
        raise ValueError(
            f"The dataset has a {messages_column!r} column (conversations) and {clash}: train on one kind of data. "
            f"Remove the other with dataset.remove_columns({clash}) or dataset.remove_columns({messages_column!r})."
        )
    return True
