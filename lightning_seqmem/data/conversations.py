"""Conversations: ``messages`` rows checked, rendered with the chat template, masked per turn, truncated by turns.

Pure functions on token lists and numpy arrays; no Lightning import. One conversation becomes an
:class:`EncodedConversation`: its ``input_ids``, the token ranges that carry loss (``label_spans``) and where each
turn ends (``turn_ends``), which is all truncation needs. Which tokens carry loss comes from the template's
``{% generation %}`` markers where it has them, else from rendering growing prefixes and taking the difference,
checked on every conversation (a template that rewrites an earlier turn once later turns follow is refused, never
trained on a wrong mask). The tokens that close an assistant turn belong to that turn, so they are trained.
Truncation by turns lives in :mod:`lightning_seqmem.data.chat_truncation`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from lightning_seqmem.data.chat_checks import DEFAULT_TRAIN_FIELD, check_conversation
from lightning_seqmem.data.chat_content import plain_turns, render_turns
from lightning_seqmem.data.chat_template import (
    MARKERS,
    ChatRenderer,
    char_to_token,
    chat_template_of,
    mask_method,
    template_fingerprint,
)
from lightning_seqmem.data.tokenizing_threads import (
    TOKENIZE_IN_FLIGHT,
    TOKENIZE_MIN_PART,
    TOKENIZE_PARTS,
    tokenizing_threads,
)
from lightning_seqmem.messages import check_choice

TRAIN_ON = ("assistant", "last_assistant", "all")
ON_EMPTY_LABELS = ("drop", "keep", "error")
__all__ = [
    "ConversationSettings",
    "EncodedConversation",
    "encode_conversation",
    "encode_rows",
    "merge_spans",
    "select_trained",
]
ENCODING = "conversations-v2"
"""Part of the cache key: v2 never pads nor cuts by the tokenizer's own settings, makes contents plain
(``chat_content``) and keeps a system message folded into the first user turn."""


@dataclass(frozen=True)
class ConversationSettings:
    """How conversations become training tokens.

    Args:
        train_on: ``"assistant"`` (every assistant turn, its content and the tokens that close it),
            ``"last_assistant"`` (the last one only) or ``"all"`` (every token).
        train_field: per-message boolean that overrides ``train_on`` for that turn (``None``: no override).
        on_empty_labels: a conversation with no trained token is ``"drop"``-ped (and counted), ``"keep"``-t
            (it adds no loss) or an ``"error"``.
    """

    train_on: str = "assistant"
    train_field: str | None = DEFAULT_TRAIN_FIELD
    on_empty_labels: str = "drop"

    def __post_init__(self) -> None:
        check_choice("train_on", self.train_on, TRAIN_ON)
        check_choice("on_empty_labels", self.on_empty_labels, ON_EMPTY_LABELS)

    def cache_key(self, tokenizer) -> list[str]:
        """What decides the cached tokens and trained spans besides the tokenizer's vocabulary: its chat template
        (and so its mask method, said here once, before any tokenizing worker forks), ``train_on`` and
        ``train_field``; not ``on_empty_labels`` (applied after the cache, like ``max_length``).

        Raises:
            ValueError: the tokenizer has no chat template (the message says how to set one).
        """
        template = chat_template_of(tokenizer)
        key = [template_fingerprint(template), mask_method(template), self.train_on, str(self.train_field)]
        return [ENCODING, *key]


@dataclass(frozen=True, eq=False)  # numpy fields: compare them with np.array_equal, not ==
class EncodedConversation:
    """One conversation as tokens.

    Attributes:
        input_ids: ``[tokens]`` int32.
        label_spans: ``[spans, 2]`` int32, sorted, disjoint ``[start, end)`` token ranges that carry loss.
        turn_ends: ``[turns]`` int32, the token end of each turn (the last is ``len(input_ids)``). A leading
            preamble the template writes before any message (a BOS, a default system prompt) is a turn of its own;
            turns a template cannot render apart are merged into one.
        keep_turns: leading turns truncation never drops (the preamble and the system message, and the turn that
            holds the system message's text where the template folds it into the first user turn).
        num_truncated: tokens dropped by truncation.
    """

    input_ids: np.ndarray
    label_spans: np.ndarray
    turn_ends: np.ndarray
    keep_turns: int = 0
    num_truncated: int = 0

    @property
    def num_trained(self) -> int:
        """Tokens that carry loss (0: nothing to learn from this conversation)."""
        return int((self.label_spans[:, 1] - self.label_spans[:, 0]).sum())

    def trained_mask(self) -> np.ndarray:
        """``[tokens]`` bool, True where the token carries loss (TRL's ``assistant_masks``)."""
        mask = np.zeros(len(self.input_ids), dtype=bool)
        for start, end in self.label_spans:
            mask[start:end] = True
        return mask

    def labels(self) -> np.ndarray:
        """Unshifted labels ``[tokens]`` int64: the token where it carries loss, else -100."""
        from lightning_seqmem.batch import IGNORE_INDEX

        return np.where(self.trained_mask(), self.input_ids, IGNORE_INDEX).astype(np.int64)

    def to_row(self) -> dict:
        """Columns for an Arrow table: int32 lists, the spans flattened to ``[s0, e0, s1, e1, ...]``."""
        return {
            "input_ids": self.input_ids,
            "label_spans": self.label_spans.reshape(-1),
            "turn_ends": self.turn_ends,
            "keep_turns": self.keep_turns,
            "num_truncated": self.num_truncated,
        }

    @classmethod
    def from_row(cls, row: Mapping) -> EncodedConversation:
        """The inverse of :meth:`to_row` (lists or arrays)."""
        return cls(
            input_ids=np.asarray(row["input_ids"], dtype=np.int32),
            label_spans=np.asarray(row["label_spans"], dtype=np.int32).reshape(-1, 2),
            turn_ends=np.asarray(row["turn_ends"], dtype=np.int32),
            keep_turns=int(row["keep_turns"]),
            num_truncated=int(row["num_truncated"]),
        )


def _prefix_refused(row, turn: int, role: str, what: str) -> ValueError:
    return ValueError(
        f"Conversation {row}, turn {turn} ({role}): the chat template {what}, so the tokens of each turn cannot be "
        "found by rendering growing prefixes (its mask would be wrong). Add {% generation %}...{% endgeneration %} "
        "markers around the assistant's output in tokenizer.chat_template, or use a template that renders earlier "
        "turns the same whatever follows (templates that drop past reasoning blocks do not)."
    )


def _wants_loss(i: int, message: Mapping, train_on: str, train_field: str | None, last_assistant: int) -> bool:
    flag = message.get(train_field) if train_field else None
    if flag is not None:
        return bool(flag)
    if train_on == "all":
        return True
    return message["role"] == "assistant" and (train_on == "assistant" or i == last_assistant)


def merge_spans(spans: list[tuple[int, int]]) -> np.ndarray:
    """``[k, 2]`` int32: the non-empty ``[start, end)`` ranges sorted, overlapping and touching ones joined."""
    merged: list[list[int]] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return np.asarray(merged, dtype=np.int32).reshape(-1, 2)


def encode_conversation(
    messages: Sequence[Mapping], renderer: ChatRenderer, row, settings: ConversationSettings = ConversationSettings()
) -> EncodedConversation:
    """Render one conversation and find its turns and trained tokens (no truncation: see ``chat_truncation.truncate``).

    Args:
        messages: the turns, checked with :func:`check_conversation`.
        renderer: the tokenizer and its template.
        row: names the conversation in errors.
        settings: ``train_on`` and ``train_field`` are read here.

    Returns:
        The :class:`EncodedConversation`; ``num_trained == 0`` flags a conversation with nothing to learn.

    Raises:
        ValueError: a bad turn; a template without markers whose rendering of an earlier turn changes once later
            turns follow; a template whose generation blocks do not match the assistant turns one to one.
    """
    messages, text, generation = _render_checked(messages, renderer, row, settings)
    return _encode_rendered(messages, text, generation, *renderer.tokenize(text), renderer, row, settings)


def _render_checked(
    messages: Sequence[Mapping], renderer: ChatRenderer, row, settings: ConversationSettings
) -> tuple[list[dict], str, list[tuple[int, int]]]:
    """The turns checked and made plain (``chat_content``: parts, numbers), and rendered: ``(turns, text, spans)``;
    a template that raises is told with the row and turn."""
    check_conversation(messages, row, settings.train_field)
    messages = plain_turns(messages, row, renderer)
    return (messages, *render_turns(renderer, messages, row))


def _encode_rendered(
    messages: Sequence[Mapping],
    text: str,
    generation: list[tuple[int, int]],
    ids: np.ndarray,
    ends: np.ndarray,
    renderer: ChatRenderer,
    row,
    settings: ConversationSettings,
) -> EncodedConversation:
    """:func:`encode_conversation` once the conversation is rendered (``text``, its generation spans) and
    tokenized (``ids`` and the character end of each token), so that a batch is tokenized in one call."""
    n = len(messages)
    chat = renderer.prepare(messages)  # converted once; its prefixes render from it
    # Character end of each message where the prefix up to it renders as the start of the whole text.
    bounds: list[int | None] = []
    for i in range(n - 1):
        prefix = renderer.try_render_prepared(chat[: i + 1])
        bounds.append(len(prefix) if prefix is not None and text.startswith(prefix) else None)
    bounds.append(len(text))
    preamble = renderer.preamble
    preamble_end = len(preamble) if preamble and text.startswith(preamble) else 0

    if renderer.method != MARKERS:
        for i, bound in enumerate(bounds):
            if bound is None:
                what = (
                    "cannot render the conversation up to it alone (it raised)"
                    if renderer.try_render_prepared(chat[: i + 1]) is None
                    else "renders it differently once later turns follow"
                )
                raise _prefix_refused(row, i, messages[i]["role"], what)

    # Turns: the preamble, then one per message, merged where a boundary is missing (possible with markers only).
    turn_chars, turn_of = ([preamble_end] if preamble_end else []), []
    for bound in bounds:
        turn_of.append(len(turn_chars))
        if bound is not None:
            turn_chars.append(bound)
    turn_ends = np.searchsorted(ends, turn_chars, side="right").tolist()  # char_to_token of each, in one call
    turn_starts = [0] + turn_ends[:-1]
    keep_turns = (turn_of[0] + 1) if messages[0]["role"] == "system" else (1 if preamble_end else 0)
    if messages[0]["role"] == "system":  # where the template folds it into a later turn, that turn stays too
        keep_turns = max(keep_turns, _turn_holding(messages[0], text, ends, turn_ends) + 1)

    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    answers: dict[int, tuple[int, int]] = {}
    if renderer.method == MARKERS:
        if len(generation) != len(assistants):
            raise ValueError(
                f"Conversation {row}: the chat template writes {len(generation)} {{% generation %}} blocks for "
                f"{len(assistants)} assistant turns; wrap every assistant turn's output in one block."
            )
        # As transformers' return_assistant_tokens_mask: from the token holding the first character to the token
        # holding the last one.
        first_last = np.searchsorted(ends, np.asarray(generation, dtype=np.int64).reshape(-1, 2) - [0, 1], "right")
        for i, (start, last) in zip(assistants, first_last.tolist()):
            answers[i] = (start, last + 1)
    else:
        for i in assistants:
            opened = renderer.try_render_prepared(chat[:i], add_generation_prompt=True)
            previous = bounds[i - 1] if i else preamble_end
            if opened is None or not text.startswith(opened) or len(opened) < previous:
                raise _prefix_refused(
                    row, i, "assistant", "does not render the generation prompt as the start of this turn"
                )
            answers[i] = (char_to_token(ends, len(opened)), char_to_token(ends, bounds[i]))

    last_assistant = assistants[-1] if assistants else -1
    spans = [(0, turn_ends[0])] if preamble_end and settings.train_on == "all" else []
    for i, message in enumerate(messages):
        if not _wants_loss(i, message, settings.train_on, settings.train_field, last_assistant):
            continue
        if i in answers and settings.train_on != "all":
            spans.append(answers[i])
        else:  # the whole turn: headers and closing tokens too (with the turns it is merged with, if any)
            spans.append((turn_starts[turn_of[i]], turn_ends[turn_of[i]]))
    return EncodedConversation(ids, merge_spans(spans), np.asarray(turn_ends, dtype=np.int32), keep_turns)


def _turn_holding(message: Mapping, text: str, ends: np.ndarray, turn_ends: list[int]) -> int:
    """Index of the turn whose tokens hold the end of ``message``'s text in ``text`` (-1: not found). A system
    message is its own turn in most templates; Llama-2's writes it inside the first user turn (``[INST]
    <<SYS>>...<</SYS>> user``) and renders nothing for it alone, so keeping the system turn alone would lose it."""
    content = message.get("content")
    content = content.strip() if isinstance(content, str) else ""
    at = text.find(content) if content else -1
    if at < 0:
        return -1
    return int(np.searchsorted(np.asarray(turn_ends), char_to_token(ends, at + len(content) - 1), side="right"))


def encode_rows(
    conversations: Sequence,
    rows: Sequence,
    renderer: ChatRenderer,
    settings: ConversationSettings = ConversationSettings(),
) -> dict[str, list]:
    """Columns for a batch of conversations (a ``datasets.map(batched=True, with_indices=True)`` body): the
    :meth:`EncodedConversation.to_row` columns plus ``num_trained``. Untruncated and unfiltered, so the cached
    tokens do not depend on ``max_length`` or ``on_empty_labels``: apply ``chat_truncation.truncate`` and
    :func:`select_trained` after."""
    columns: dict[str, list] = {}
    conversations, rows = list(conversations), list(rows)

    def finish(part: list, tokenized) -> None:
        for (row, (messages, text, generation)), raw in zip(part, tokenized.result()):
            ids, ends = renderer.ids_and_ends(raw)
            encoded = _encode_rendered(messages, text, generation, ids, ends, renderer, row, settings)
            for key, value in {**encoded.to_row(), "num_trained": encoded.num_trained}.items():
                columns.setdefault(key, []).append(value)

    # The Rust tokenizer releases the GIL: parts are tokenized on threads of our own (two in flight) while the
    # main thread renders the next part and finishes an earlier one (Python), so the work spreads over two cores;
    # parts are finished in order, so rows keep theirs.
    step = max(TOKENIZE_MIN_PART, -(-len(rows) // TOKENIZE_PARTS))
    pending: list = []
    with tokenizing_threads(renderer.thread_safe) as threads:
        for lo in range(0, len(rows), step):
            part = [
                (row, _render_checked(messages, renderer, row, settings))
                for messages, row in zip(conversations[lo : lo + step], rows[lo : lo + step])
            ]
            pending.append((part, threads.submit(renderer.encode_raw, [t for _, (_, t, _) in part])))
            if len(pending) > TOKENIZE_IN_FLIGHT:
                finish(*pending.pop(0))
        for waiting in pending:
            finish(*waiting)
    return columns


def select_trained(
    num_trained: Sequence[int] | np.ndarray, on_empty_labels: str = "drop", rows: Sequence | None = None
) -> tuple[np.ndarray, int]:
    """Which conversations to train on, given how many tokens of each carry loss.

    Returns:
        ``(indices, dropped)``: the positions kept, and how many conversations with no trained token were dropped
        (0 unless ``on_empty_labels="drop"``).

    Raises:
        ValueError: ``on_empty_labels="error"`` and a conversation has no trained token (named by ``rows``).
    """
    check_choice("on_empty_labels", on_empty_labels, ON_EMPTY_LABELS)
    counts = np.asarray(num_trained, dtype=np.int64)
    empty = np.flatnonzero(counts == 0)
    if len(empty) and on_empty_labels == "error":
        first = rows[empty[0]] if rows is not None else int(empty[0])
        raise ValueError(
            f"{len(empty)} conversation(s) have no trained token (first: conversation {first}), e.g. no assistant "
            "turn under train_on='assistant', or truncation left none: fix the data, or pass on_empty_labels='drop' "
            "(dropped and counted) or 'keep' (trained on nothing)."
        )
    if on_empty_labels == "drop":
        return np.flatnonzero(counts > 0), len(empty)
    return np.arange(len(counts)), 0
