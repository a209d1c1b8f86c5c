"""Preference pairs as batches of examples: their tokens checked and cut by the spans of ``preference`` (the same
TRL truncation, computed on lengths), reference log-probabilities carried along, and the padded collator (TRL's
``[2B, L]`` layout: the chosen sequences of pairs ``0..P-1``, then the rejected ones). Nothing is counted here:
collators run in dataloader workers."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from lightning_seqmem.batch import COMPLETION_MASK, IGNORE_INDEX, REF_LOGPS_KEYS
from lightning_seqmem.batching.collate import PadCollator, _fill
from lightning_seqmem.batching.preference import (
    CHOSEN,
    REJECTED,
    PairSpans,
    PreferenceLimits,
    identical_completions,
    name_rows,
    preference_spans,
)
from lightning_seqmem.data.columns import PREFERENCE_IDS
from lightning_seqmem.messages import short_repr


def _flat(rows: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    flat = np.concatenate(rows) if len(rows) else np.zeros(0, np.int64)
    return flat, np.concatenate([[0], np.cumsum(lengths)])


def pair_tokens(examples: Sequence[Mapping[str, Any]], first_row: int = 0) -> list[list[np.ndarray]]:
    """``[prompts, chosen, rejected]``: the token arrays of every pair, checked.

    Raises:
        ValueError: a pair missing ``chosen_ids`` or ``rejected_ids`` (a missing prompt is an empty one), naming
            the row.
    """
    out: list[list[np.ndarray]] = [[], [], []]
    for i, ex in enumerate(examples):
        for j, key in enumerate(PREFERENCE_IDS):
            ids = ex.get(key)
            if ids is None and j:
                raise ValueError(
                    f"row {first_row + i}: the pair has no {key!r} (keys: {short_repr(sorted(ex))}); "
                    f"every pair needs {PREFERENCE_IDS[1]!r} and {PREFERENCE_IDS[2]!r}."
                )
            out[j].append(np.asarray(ids if ids is not None else [], dtype=np.int64))
    return out


def _tokens_and_spans(
    examples: Sequence[Mapping[str, Any]], limits: PreferenceLimits, first_row: int = 0
) -> tuple[list[list[np.ndarray]], PairSpans]:
    tokens = pair_tokens(examples, first_row)
    lengths = [np.fromiter(map(len, side), dtype=np.int64, count=len(side)) for side in tokens]
    return tokens, preference_spans(*lengths, limits, first_row=first_row)


def check_pairs(examples: Sequence[Mapping[str, Any]], limits: PreferenceLimits, first_row: int = 0) -> PairSpans:
    """Check a dataset's pairs and plan their truncation; warn about identical pairs and pairs that lose a
    completion (both counted in :meth:`PairSpans.dropped`; drop ``spans.lost`` before batching).

    Raises:
        ValueError: as :func:`pair_tokens` and :func:`preference_spans`, naming the row.
    """
    (prompts, chosen, rejected), spans = _tokens_and_spans(examples, limits, first_row)
    # Compared as kept: completions that differ only in what truncation cuts carry no signal either (and equal
    # kept completions mean equal sequences: the prompt part then has the same length on both sides).
    kept = [
        [ids[a : a + n] for ids, a, n in zip(side, spans.completion_start[s], spans.completion_kept[s])]
        for s, side in ((CHOSEN, chosen), (REJECTED, rejected))
    ]
    identical = identical_completions(*_flat(kept[CHOSEN]), *_flat(kept[REJECTED])) & ~spans.lost
    spans = replace(spans, identical=identical)
    if identical.any():
        warnings.warn(
            f"{int(identical.sum())} pair(s) with chosen == rejected ({name_rows(identical, first_row)}): "
            "no preference signal in them (compared after truncation).",
            stacklevel=2,
        )
    if spans.lost.any():
        warnings.warn(
            f"{int(spans.lost.sum())} pair(s) lose a whole completion to truncation "
            f"({name_rows(spans.lost, first_row)}): drop them (PairSpans.lost) or raise max_length.",
            stacklevel=2,
        )
    return spans


def pair_sequences(
    examples: Sequence[Mapping[str, Any]], limits: PreferenceLimits
) -> tuple[list[np.ndarray], np.ndarray]:
    """The ``2 * pairs`` truncated sequences of a batch in TRL's order (chosen ``0..P-1``, then rejected) and the
    number of prompt tokens each keeps.

    Raises:
        ValueError: bad pairs (:func:`pair_tokens`, :func:`preference_spans`), or a pair that lost a completion
            (it would be kept silently with no signal: drop ``PairSpans.lost`` at dataset level).
    """
    (prompts, chosen, rejected), spans = _tokens_and_spans(examples, limits)
    if spans.lost.any():
        raise ValueError(
            f"{name_rows(spans.lost, 0)} of the batch lost a whole completion to truncation; drop such "
            "pairs before batching (check_pairs(...).lost)."
        )
    sequences = []
    for side, completions in ((CHOSEN, chosen), (REJECTED, rejected)):
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            ps, cs = spans.prompt_start[side, i], spans.completion_start[side, i]
            sequences.append(
                np.concatenate(
                    [prompt[ps : ps + spans.prompt_kept[side, i]], completion[cs : cs + spans.completion_kept[side, i]]]
                )
            )
    return sequences, spans.prompt_kept.reshape(-1)


def ref_logps(examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """The precomputed reference log-probabilities the examples carry, as ``[pairs]`` tensors (TRL's keys)."""
    out = {}
    for key in REF_LOGPS_KEYS:
        if not examples or key not in examples[0]:
            continue
        for i, ex in enumerate(examples):
            if not isinstance(ex[key], numbers.Real) and not (hasattr(ex[key], "ndim") and ex[key].ndim == 0):
                raise ValueError(
                    f"example {i}: {key!r} is {short_repr(ex[key])}; DPO takes one reference log-probability per "
                    "sequence (the sum over the completion's tokens), not one per token."
                )
        out[key] = torch.tensor([float(ex[key]) for ex in examples])
    return out


class PreferenceCollator:
    """Pairs to TRL's padded layout: ``[2B, L]`` rows, the chosen sequences first, then the rejected ones.

    Args:
        pad_token_id: id written into padding slots.
        limits: truncation (:class:`PreferenceLimits`); with only ``max_length`` and ``truncation_mode`` the batch
            equals TRL's ``DataCollatorForPreference(pad_token_id, max_length, truncation_mode,
            pad_to_multiple_of)``.
        pad_to_multiple_of: round ``L`` up to a multiple of this, never past ``max_length`` (TRL's may pass it).
        pad_to_max_length: always ``L = max_length``, so the allocator reuses the same blocks.
        return_labels: add ``labels`` (the tokens on completions, -100 elsewhere; the batch contract's key). Leave
            it off for code that passes its own ``labels`` to the model (TRL's loss does).

    Each example is ``{"prompt_ids", "chosen_ids", "rejected_ids"}`` (lists or arrays), optionally with
    ``ref_chosen_logps`` and ``ref_rejected_logps`` (returned as ``[B]`` tensors). Returns ``input_ids``,
    ``attention_mask``, ``completion_mask`` (and ``labels``), ``LongTensor[2B, L]``.

    Example::

        >>> out = PreferenceCollator(0, PreferenceLimits(None), pad_to_multiple_of=None)(
        ...     [{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5]}])
        >>> out["input_ids"].tolist(), out["completion_mask"].tolist()
        ([[1, 2, 3, 0], [1, 2, 4, 5]], [[0, 0, 1, 0], [0, 0, 1, 1]])
    """

    def __init__(
        self,
        pad_token_id: int,
        limits: PreferenceLimits,
        pad_to_multiple_of: int | None = 8,
        pad_to_max_length: bool = False,
        return_labels: bool = True,
    ) -> None:
        # The padded length follows the same rule as every other padded batch: PadCollator owns it.
        self._pad = PadCollator(
            pad_token_id,
            max_length=limits.max_length,
            pad_to_multiple_of=pad_to_multiple_of,
            pad_to_max_length=pad_to_max_length,
        )
        self.limits = limits
        self.return_labels = return_labels

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        sequences, prompt_kept = pair_sequences(examples, self.limits)
        lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
        length = self._pad.padded_length(int(lengths.max(initial=1)))
        input_ids = np.full((len(sequences), length), self._pad.pad_token_id, dtype=np.int64)
        _fill(sequences, lengths, input_ids)
        slots = np.arange(length)
        attention_mask = slots < lengths[:, None]
        completion_mask = attention_mask & (slots >= prompt_kept[:, None])
        out = {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention_mask.astype(np.int64)),
            COMPLETION_MASK: torch.from_numpy(completion_mask.astype(np.int64)),
        }
        if self.return_labels:
            out["labels"] = torch.from_numpy(np.where(completion_mask, input_ids, IGNORE_INDEX))
        return {**out, **ref_logps(examples)}
