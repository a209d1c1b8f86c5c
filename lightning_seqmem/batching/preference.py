"""Preference pairs (prompt, chosen, rejected): TRL's DPO truncation on lengths (their batches: ``pair_collate``).

Truncation as TRL's guide to reducing memory describes it, in two stages: the prompt keeps its end
(``max_prompt_length``) and each completion keeps its start (``max_completion_length``); then each sequence
(prompt + completion) is cut to ``max_length`` as TRL 1.16's ``DataCollatorForPreference`` cuts it:
``keep_start`` keeps its first ``max_length`` tokens (the completion's end goes first), ``keep_end`` its last
``max_length`` tokens (the prompt's start goes first, then the completion's start). Under ``keep_end`` the chosen
and the rejected sequence of one pair may keep different parts of the prompt, so spans are per side.

Everything is computed on lengths with numpy (:func:`preference_spans`) and counted at dataset level
(:meth:`PairSpans.dropped`); the collators (``pair_collate``, ``pair_packing``) apply the same spans to the tokens
and count nothing (they run in dataloader workers). Sequence order in a batch is TRL's: the chosen sequences of
pairs ``0..P-1``, then the rejected ones, so per-sequence values ``chunk(2)`` into chosen and rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lightning_seqmem.batching.truncation import check_max_length, check_part_limits
from lightning_seqmem.messages import check_choice

CHOSEN, REJECTED = 0, 1
"""Index of each side on the first axis of the ``[2, rows]`` arrays of :class:`PairSpans`."""

TRUNCATION_MODES = ("keep_start", "keep_end")
OVERLONG_PROMPT_CHOICES = ("drop", "error")


@dataclass(frozen=True)
class PreferenceLimits:
    """Validated limits for preference pairs (TRL's names and meanings).

    Args:
        max_length: limit on each sequence, prompt + completion; ``None`` for none.
        max_prompt_length: prompt limit; the END of the prompt is kept (the question sits next to the answers).
        max_completion_length: limit on each completion; its START is kept.
        truncation_mode: how ``max_length`` cuts a sequence: ``"keep_start"`` keeps its first ``max_length``
            tokens, ``"keep_end"`` its last (TRL deprecates ``keep_end``; kept for parity).
        on_overlong_prompt: a pair whose prompt alone (after ``max_prompt_length``) is longer than ``max_length``
            trains nothing: ``"drop"`` leaves it out (counted as ``pairs_dropped_overlong_prompt``, warned once),
            ``"error"`` refuses the data naming the rows. One outlier should not refuse a whole dataset.

    Raises:
        ValueError: a limit below its minimum, an unknown mode, or ``max_prompt_length >= max_length`` (a prompt at
            its limit would leave no room for a completion).
    """

    max_length: int | None
    max_prompt_length: int | None = None
    max_completion_length: int | None = None
    truncation_mode: str = "keep_start"
    on_overlong_prompt: str = "drop"

    def __post_init__(self) -> None:
        check_max_length(self.max_length)
        check_choice("truncation_mode", self.truncation_mode, TRUNCATION_MODES)
        check_choice("on_overlong_prompt", self.on_overlong_prompt, OVERLONG_PROMPT_CHOICES)
        check_part_limits(self.max_prompt_length, self.max_completion_length)
        if (
            self.max_length is not None
            and self.max_prompt_length is not None
            and self.max_prompt_length >= self.max_length
        ):
            raise ValueError(
                f"max_prompt_length ({self.max_prompt_length}) >= max_length ({self.max_length}) leaves "
                "no room for a completion: lower max_prompt_length or raise max_length."
            )


def sequence_spans(
    prompt_lengths: np.ndarray,
    completion_lengths: np.ndarray,
    max_length: int | None,
    truncation_mode: str = "keep_start",
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What ``max_length`` keeps of each prompt + completion sequence, as TRL's collator slices it.

    Args:
        prompt_lengths, completion_lengths: ``[n]`` token counts.
        max_length: the limit; ``None`` keeps everything.
        truncation_mode: ``"keep_start"`` (slice ``[:max_length]``) or ``"keep_end"`` (slice ``[-max_length:]``).

    Returns:
        ``(prompt_start, prompt_kept, completion_start, completion_kept)``, ``[n]`` each: a sequence keeps prompt
        tokens ``prompt_start : prompt_start + prompt_kept`` and likewise for its completion.

    Example::

        >>> [a.tolist() for a in sequence_spans(np.array([4]), np.array([3]), 5, "keep_end")]
        [[2], [2], [0], [3]]
    """
    p = np.asarray(prompt_lengths, dtype=np.int64)
    c = np.asarray(completion_lengths, dtype=np.int64)
    zero = np.zeros_like(p)
    if max_length is None:
        return zero, p, zero.copy(), c
    if truncation_mode == "keep_start":
        p_kept = np.minimum(p, max_length)
        return zero, p_kept, zero.copy(), np.minimum(c, max_length - p_kept)
    c_kept = np.minimum(c, max_length)
    p_kept = np.minimum(p, max_length - c_kept)
    return p - p_kept, p_kept, c - c_kept, c_kept


def name_rows(mask: np.ndarray, first_row: int, shown: int = 3) -> str:
    """``"rows 4, 9, 12 (+2 more)"`` for the ``True`` places of ``mask`` (bounded, for error messages)."""
    rows = np.flatnonzero(mask) + first_row
    more = f" (+{len(rows) - shown} more)" if len(rows) > shown else ""
    return f"row{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows[:shown].tolist()))}{more}"


@dataclass(frozen=True)
class PairSpans:
    """What truncation keeps of every pair, on lengths: ``[2, rows]`` arrays (side :data:`CHOSEN`, :data:`REJECTED`).

    Positions are in the original tokens: side ``s`` of pair ``i`` keeps prompt tokens ``prompt_start[s, i] :
    prompt_start[s, i] + prompt_kept[s, i]`` and completion tokens ``completion_start[s, i] : ... +
    completion_kept[s, i]``.
    """

    prompt_lengths: np.ndarray  # [rows]
    completion_lengths: np.ndarray  # [2, rows]
    prompt_start: np.ndarray
    prompt_kept: np.ndarray
    completion_start: np.ndarray
    completion_kept: np.ndarray
    identical: np.ndarray | None = None  # [rows] chosen == rejected after truncation, where known
    overlong_prompt: np.ndarray | None = None  # [rows] prompt alone longer than max_length (kept no completion)

    @property
    def lost(self) -> np.ndarray:
        """``[rows]`` bool: pairs that lost a whole completion to truncation, overlong prompts included (no signal
        left: drop them)."""
        return (self.completion_kept == 0).any(axis=0)

    @property
    def overlong(self) -> np.ndarray:
        """``[rows]`` bool: pairs whose prompt alone is longer than ``max_length`` (part of :attr:`lost`)."""
        return self.overlong_prompt if self.overlong_prompt is not None else np.zeros(self.lost.shape, dtype=bool)

    @property
    def sequence_lengths(self) -> np.ndarray:
        """``[2, rows]`` tokens of each sequence after truncation."""
        return self.prompt_kept + self.completion_kept

    @property
    def pair_lengths(self) -> np.ndarray:
        """``[rows]`` tokens of both sequences of each pair: the item a packed row takes."""
        return self.sequence_lengths.sum(axis=0)

    def dropped(self) -> dict[str, int]:
        """Counts for ``stats()``, named as the other data kinds name them: tokens cut (in all, and from prompts,
        both sequences' copies, from chosen and from rejected completions), pairs that lost a completion, pairs
        with chosen == rejected, pairs dropped for a prompt longer than ``max_length`` on its own."""
        prompt = int((self.prompt_lengths - self.prompt_kept).sum())
        chosen, rejected = (int(n) for n in (self.completion_lengths - self.completion_kept).sum(axis=1))
        return {
            "tokens_truncated": prompt + chosen + rejected,
            "prompt_tokens_truncated": prompt,
            "chosen_tokens_truncated": chosen,
            "rejected_tokens_truncated": rejected,
            "rows_without_completion": int((self.lost & ~self.overlong).sum()),
            "rows_chosen_equals_rejected": int(self.identical.sum()) if self.identical is not None else 0,
            "pairs_dropped_overlong_prompt": int(self.overlong.sum()),
        }


def preference_spans(
    prompt_lengths: np.ndarray,
    chosen_lengths: np.ndarray,
    rejected_lengths: np.ndarray,
    limits: PreferenceLimits,
    first_row: int = 0,
) -> PairSpans:
    """Both truncation stages for every pair at once, on lengths only (numpy, no tokens touched).

    Args:
        prompt_lengths, chosen_lengths, rejected_lengths: ``[rows]`` token counts.
        limits: the limits.
        first_row: dataset index of the first row, for error messages.

    A prompt longer than ``max_length`` on its own (after ``max_prompt_length``) leaves its pair no completion
    under either mode: the pair is marked (``overlong_prompt``) and lost, or refused under
    ``on_overlong_prompt="error"``.

    Raises:
        ValueError: an empty completion, or (``on_overlong_prompt="error"``) an overlong prompt, naming the rows.

    Example::

        >>> lim = PreferenceLimits(max_length=6, max_prompt_length=3, max_completion_length=4)
        >>> spans = preference_spans(np.array([5]), np.array([5]), np.array([2]), lim)
        >>> spans.sequence_lengths.tolist(), spans.prompt_start.tolist()
        ([[6], [5]], [[2], [2]])
    """
    p = np.asarray(prompt_lengths, dtype=np.int64)
    c = np.stack([np.asarray(chosen_lengths, dtype=np.int64), np.asarray(rejected_lengths, dtype=np.int64)])
    for side, name in ((CHOSEN, "chosen"), (REJECTED, "rejected")):
        if (c[side] == 0).any():
            raise ValueError(
                f"{name_rows(c[side] == 0, first_row)}: empty {name} completion; a pair needs both "
                "completions (drop such rows from the dataset)."
            )
    p1 = p if limits.max_prompt_length is None else np.minimum(p, limits.max_prompt_length)
    overlong = p1 > limits.max_length if limits.max_length is not None else np.zeros(p.shape, dtype=bool)
    if limits.on_overlong_prompt == "error" and overlong.any():
        raise ValueError(
            f"{name_rows(overlong, first_row)}: the prompt alone is longer than max_length="
            f"{limits.max_length}; set max_prompt_length below max_length or drop these rows "
            '(on_overlong_prompt="drop" leaves them out).'
        )
    c1 = c if limits.max_completion_length is None else np.minimum(c, limits.max_completion_length)
    p_start, p_kept, c_start, c_kept = sequence_spans(
        np.broadcast_to(p1, c1.shape), c1, limits.max_length, limits.truncation_mode
    )
    # keep_end would cut such a prompt's start to fit a completion: the pair is dropped under both modes alike.
    c_kept = np.where(overlong, 0, c_kept)
    return PairSpans(
        prompt_lengths=p,
        completion_lengths=c,
        prompt_start=p_start + (p - p1),
        prompt_kept=p_kept,
        completion_start=c_start,
        completion_kept=c_kept,
        overlong_prompt=overlong,
    )


def identical_completions(
    chosen_flat: np.ndarray, chosen_offsets: np.ndarray, rejected_flat: np.ndarray, rejected_offsets: np.ndarray
) -> np.ndarray:
    """``[rows]`` bool: chosen == rejected, on flat token arrays and ``[rows + 1]`` offsets (Arrow's layout).

    Only rows of equal lengths are compared, token by token in one vectorised pass.
    """
    c_len, r_len = np.diff(chosen_offsets), np.diff(rejected_offsets)
    same = np.flatnonzero(c_len == r_len)
    lengths = c_len[same]
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    differs = (
        chosen_flat[np.repeat(chosen_offsets[same], lengths) + within]
        != rejected_flat[np.repeat(rejected_offsets[same], lengths) + within]
    )
    out = np.zeros(len(c_len), dtype=bool)
    out[same] = np.bincount(np.repeat(np.arange(len(same)), lengths), weights=differs, minlength=len(same)) == 0
    return out
