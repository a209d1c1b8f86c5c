"""Preference pairs as conversations: the prompt's turns, then the chosen or the rejected turns, rendered with the
tokenizer's chat template into the three token columns of text pairs (``prompt_ids``, ``chosen_ids``,
``rejected_ids``), so everything after tokenizing (truncation, padded and packed pair batches) is shared.

Tokenized as TRL's DPO trainer does, so the ids are the same: the prompt rendered with the generation prompt, each
full conversation rendered, and each completion starting where the prompt's tokens and the full sequence's part.
A prompt without its own column is the turns the chosen and rejected conversations share (TRL's implicit prompt).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_seqmem.data.chat_checks import check_conversation
from lightning_seqmem.data.chat_content import plain_turns, render_turns
from lightning_seqmem.data.chat_template import ChatRenderer, chat_template_of, template_fingerprint
from lightning_seqmem.data.tokenizing_threads import TOKENIZE_MIN_PART, TOKENIZE_PARTS, tokenizing_threads

PAIR_SIDES = ("chosen", "rejected")


def is_message_list(feature: Any) -> bool:
    """Whether a ``datasets`` feature is a list of ``{"role", "content", ...}`` turns."""
    inner = getattr(feature, "feature", None)
    if isinstance(feature, list) and feature:  # the old spelling of a list feature: ``[inner]``
        inner = feature[0]
    return isinstance(inner, Mapping) and "role" in inner


def pair_form(features: Mapping[str, Any]) -> str:
    """``"conversations"`` where the ``chosen`` column holds turns, else ``"text"``."""
    return "conversations" if is_message_list(features.get("chosen")) else "text"


@dataclass(frozen=True)
class ChatPairs:
    """How conversation-form pairs become tokens: the token cache asks it for its key and source columns.

    Args:
        has_prompt: the data have a ``prompt`` column; without one the prompt is the shared leading turns.
    """

    has_prompt: bool = True

    @property
    def source_columns(self) -> list[str]:
        return (["prompt"] if self.has_prompt else []) + list(PAIR_SIDES)

    def cache_key(self, tokenizer: Any) -> list[str]:
        """The template decides the tokens (a new template, a new cache entry); v2: contents made plain."""
        return ["chat-pairs-v2", template_fingerprint(chat_template_of(tokenizer)), str(self.has_prompt)]


def shared_turns(chosen: Sequence[Mapping], rejected: Sequence[Mapping]) -> int:
    """How many leading turns two conversations share, leaving each at least its last turn (identical
    conversations then give identical completions, which are counted and warned about, not an empty pair)."""
    limit = min(len(chosen), len(rejected)) - 1
    n = 0
    while n < limit and chosen[n] == rejected[n]:
        n += 1
    return n


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading ids ``a`` and ``b`` share (usually all of the shorter: one list comparison; otherwise
    vectorised, as prompts run to thousands of tokens)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0])


def _turns(value: Any, row: int, column: str, allow_empty: bool, renderer: ChatRenderer) -> list:
    if allow_empty and isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and len(value) == 0:
        return []
    if isinstance(value, str):
        raise ValueError(
            f"Row {row}, column {column!r} is text ({value!r:.60}) while the pair's other columns are conversations: "
            "give every column of a pair in one form (all lists of {'role', 'content'} turns, or all strings)."
        )
    where = f"{row} (column {column!r})"
    check_conversation(value, where, train_field=None)
    return plain_turns(value, where, renderer)


def encode_chat_pairs(
    batch: Mapping[str, Sequence],
    rows: Sequence[int],
    renderer: ChatRenderer,
    settings: ChatPairs,
    encode: Callable[[list[str]], list[list[int]]] | None = None,
) -> dict[str, list]:
    """Token columns of a batch of conversation-form pairs.

    Args:
        batch: ``prompt`` (unless ``settings.has_prompt`` is False), ``chosen``, ``rejected`` turn lists.
        rows: dataset index of each pair, for errors.
        renderer: the tokenizer and its chat template.
        encode: texts to token ids as ``apply_chat_template`` tokenizes them (no special tokens added); default:
            the renderer's tokenizer (``encode.batch_encoder``, ids only, is what the token cache passes).

    Returns:
        ``{"prompt_ids", "chosen_ids", "rejected_ids", "length"}``.

    Raises:
        ValueError: a turn without ``role`` or ``content``, an unknown role, a content ``chat_content`` refuses, an
            empty chosen or rejected list, a column in text form next to conversations, or a template that raises;
            the message names the row and column (and turn).
    """
    texts, parted = [], []  # parted: pairs whose prompt tokens and full sequence part before the prompt ends
    # Threads only for Rust calls alone (a BatchEncoder's first call also runs the tokenizer's own, to compare).
    safe = renderer.thread_safe if encode is None else getattr(encode, "fast", False) and encode.checked
    if encode is None:
        encode = _ids_of(renderer)
    # Each part is tokenized on a thread (the Rust tokenizer releases the GIL) while the next one is rendered.
    step, parts = 3 * max(TOKENIZE_MIN_PART, -(-len(rows) // TOKENIZE_PARTS)), []
    with tokenizing_threads(safe) as threads:
        for i, row in enumerate(rows):
            chosen = _turns(batch["chosen"][i], row, "chosen", False, renderer)
            rejected = _turns(batch["rejected"][i], row, "rejected", False, renderer)
            if settings.has_prompt:
                prompt = _turns(batch["prompt"][i], row, "prompt", True, renderer)
            else:
                n = shared_turns(chosen, rejected)
                prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
            texts += [
                render_turns(renderer, prompt, f"{row} (prompt)", add_generation_prompt=True, spans=False)[0],
                render_turns(renderer, prompt + chosen, f"{row} (prompt + chosen)", spans=False)[0],
                render_turns(renderer, prompt + rejected, f"{row} (prompt + rejected)", spans=False)[0],
            ]
            if len(texts) >= step or i == len(rows) - 1:
                parts.append(threads.submit(encode, texts))
                texts = []
        ids = [one for part in parts for one in part.result()]
    out: dict[str, list] = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": [], "length": []}
    for i, row in enumerate(rows):
        prompt, chosen, rejected = ids[3 * i : 3 * i + 3]
        cut = min(common_prefix(prompt, chosen), common_prefix(prompt, rejected))
        if cut < len(prompt):
            parted.append(row)
        out["prompt_ids"].append(prompt[:cut])
        out["chosen_ids"].append(chosen[cut:])
        out["rejected_ids"].append(rejected[cut:])
        out["length"].append(len(chosen) + len(rejected) - cut)
    if parted:
        warnings.warn(
            f"Pairs {parted[:5]}{' ...' if len(parted) > 5 else ''}: the prompt rendered with the "
            "generation prompt is not a prefix of the rendered prompt + completion (the template writes the end of "
            "the prompt differently when a completion follows). Each completion starts where they part, as TRL does, "
            "so the model is trained on a context slightly different from the one it sees when generating. Use a "
            "template that renders the generation prompt as the assistant turn begins to avoid it.",
            UserWarning,
            stacklevel=2,
        )
    return out


def _ids_of(renderer: ChatRenderer) -> Callable[[list[str]], list[list[int]]]:
    """Texts to ids with the renderer's tokenizer (what ``encode_chat_pairs`` uses without an ``encode``)."""
    return lambda texts: [t.tolist() for t, _ in renderer.tokenize_batch(texts)]
