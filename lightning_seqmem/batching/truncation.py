"""Truncation: cutting token lists to a length, prompt/completion truncation and the accounting of what was cut.

Pure functions on token lists and numpy arrays. Counting happens here, at dataset level, never inside a collator:
a collator runs in dataloader workers, so a counter on it would be lost (or multiplied) across processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_seqmem.messages import check_choice

TRUNCATION_SIDES = ("right", "left")
MIN_MAX_LENGTH = 2  # a causal LM needs an input and a target: the one rule every max_length check applies


def valid_max_length(value: object) -> bool:
    """Whether ``value`` is an integral ``max_length`` of at least :data:`MIN_MAX_LENGTH` tokens."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= MIN_MAX_LENGTH


def check_truncation_side(side: str) -> None:
    """Raise a ``ValueError`` listing the valid sides when ``side`` is not one of them."""
    check_choice("truncation_side", side, TRUNCATION_SIDES)


def check_max_length(max_length: int | None, name: str = "max_length") -> None:
    """A causal LM needs at least two tokens to predict one, so any limit below 2 is a configuration error."""
    if max_length is not None and not valid_max_length(max_length):
        raise ValueError(f"{name}={max_length!r} is too small: set {name} to an integer >= {MIN_MAX_LENGTH}.")


def count_truncated(lengths: Sequence[int] | np.ndarray, max_length: int | None) -> int:
    """Number of tokens lost when every document is cut to ``max_length``.

    Args:
        lengths: token count of each document.
        max_length: the limit; ``None`` means no limit (nothing is lost).

    Returns:
        ``sum(max(0, length - max_length))``.

    Example::

        >>> count_truncated([3, 10, 7], 5)
        7
    """
    if max_length is None:
        return 0
    arr = np.asarray(lengths, dtype=np.int64)
    return int(np.clip(arr - max_length, 0, None).sum())


def cut_tokens(ids, max_length: int | None, side: str = "right"):
    """``ids`` (a list or an array, returned as the same kind) cut to at most ``max_length`` tokens, keeping the
    start (``"right"``) or the end (``"left"``); a slice, so an array stays a view."""
    if max_length is None or len(ids) <= max_length:
        return ids
    return ids[:max_length] if side == "right" else ids[len(ids) - max_length :]


def truncate_ids(ids: Sequence[int], max_length: int | None, side: str = "right") -> list[int]:
    """Cut ``ids`` to at most ``max_length`` tokens, keeping the start (``"right"``) or the end (``"left"``)."""
    return cut_tokens(list(ids), max_length, side)


def check_part_limits(max_prompt_length: int | None, max_completion_length: int | None) -> None:
    """The per-part limits of prompt/completion and preference data: each ``None`` (no limit) or ``>= 1``."""
    for name, value in (("max_prompt_length", max_prompt_length), ("max_completion_length", max_completion_length)):
        if value is not None and value < 1:
            raise ValueError(f"{name}={value} must be >= 1 (or None for no limit).")


@dataclass(frozen=True)
class PromptCompletionLimits:
    """Validated limits for prompt/completion truncation.

    Args:
        max_length: limit on ``len(prompt) + len(completion)``; ``None`` for none (packing keeps long rows).
        max_prompt_length: prompt limit; the END of the prompt is kept (the question sits next to the answer).
        max_completion_length: completion limit; the START of the completion is kept.
        truncation_side: what ``max_length`` cuts first: ``"right"`` the completion's end, ``"left"`` the prompt's
            start (then the completion's end).

    Raises:
        ValueError: a limit below its minimum, or ``max_prompt_length + max_completion_length > max_length``.
    """

    max_length: int | None
    max_prompt_length: int | None = None
    max_completion_length: int | None = None
    truncation_side: str = "right"

    def __post_init__(self) -> None:
        check_max_length(self.max_length)
        check_truncation_side(self.truncation_side)
        check_part_limits(self.max_prompt_length, self.max_completion_length)
        if (
            self.max_length is not None
            and self.max_prompt_length is not None
            and self.max_completion_length is not None
            and self.max_prompt_length + self.max_completion_length > self.max_length
        ):
            raise ValueError(
                f"max_prompt_length ({self.max_prompt_length}) + max_completion_length "
                f"({self.max_completion_length}) > max_length ({self.max_length}): lower one of the two limits "
                "or raise max_length so every row fits."
            )


def truncate_prompt_completion(
    prompt: Sequence[int], completion: Sequence[int], limits: PromptCompletionLimits
) -> tuple[list[int], list[int]]:
    """Apply the prompt limit (keep the end), the completion limit (keep the start), then ``max_length``.

    Returns:
        ``(prompt, completion)`` after truncation; the completion may be empty, which the caller must report.

    Example::

        >>> lim = PromptCompletionLimits(max_length=5, max_prompt_length=3, max_completion_length=2)
        >>> truncate_prompt_completion([1, 2, 3, 4], [5, 6, 7], lim)
        ([2, 3, 4], [5, 6])
    """
    # One rule: the vectorised one, on this row's lengths.
    (p_off, p_keep, c_keep), p = prompt_completion_spans([len(prompt)], [len(completion)], limits), list(prompt)
    return p[int(p_off[0]) : int(p_off[0] + p_keep[0])], list(completion)[: int(c_keep[0])]


def prompt_completion_example(
    prompt: Sequence[int],
    completion: Sequence[int],
    limits: PromptCompletionLimits,
    completion_only_loss: bool = True,
) -> dict[str, list[int]]:
    """Truncate one prompt/completion pair and build ``input_ids`` and unshifted ``labels``.

    Returns:
        ``{"input_ids", "labels", "num_truncated", "completion_length"}``; prompt labels are -100 when
        ``completion_only_loss``. ``completion_length == 0`` marks a row with nothing left to learn from.

    Example::

        >>> lim = PromptCompletionLimits(max_length=4)
        >>> prompt_completion_example([1, 2], [3, 4, 5], lim)["labels"]
        [-100, -100, 3, 4]
    """
    p, c = truncate_prompt_completion(prompt, completion, limits)
    ids = p + c
    from lightning_seqmem.batch import IGNORE_INDEX

    labels = ([IGNORE_INDEX] * len(p) if completion_only_loss else list(p)) + c
    return {
        "input_ids": ids,
        "labels": labels,
        "num_truncated": len(prompt) + len(completion) - len(ids),
        "completion_length": len(c),
    }


def prompt_completion_spans(
    prompt_lengths: np.ndarray, completion_lengths: np.ndarray, limits: PromptCompletionLimits
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``truncate_prompt_completion`` for every row at once, on lengths only (numpy, no tokens touched).

    Args:
        prompt_lengths, completion_lengths: ``[rows]`` token counts.
        limits: the same limits, with the same meaning.

    Returns:
        ``(prompt_offset, prompt_kept, completion_kept)`` ``[rows]`` each: row ``i`` keeps prompt tokens
        ``prompt_offset[i] : prompt_offset[i] + prompt_kept[i]`` and the first ``completion_kept[i]`` completion
        tokens. Tokens cut: ``prompt_lengths + completion_lengths - prompt_kept - completion_kept``.

    Example::

        >>> lim = PromptCompletionLimits(max_length=5, max_prompt_length=3, max_completion_length=2)
        >>> [a.tolist() for a in prompt_completion_spans(np.array([4]), np.array([3]), lim)]
        [[1], [3], [2]]
    """
    plen = np.asarray(prompt_lengths, dtype=np.int64)
    clen = np.asarray(completion_lengths, dtype=np.int64)
    p_keep = plen if limits.max_prompt_length is None else np.minimum(plen, limits.max_prompt_length)
    p_off = plen - p_keep  # the prompt limit keeps the prompt's end
    c_keep = clen if limits.max_completion_length is None else np.minimum(clen, limits.max_completion_length)
    if limits.max_length is not None:
        excess = np.maximum(p_keep + c_keep - limits.max_length, 0)
        if limits.truncation_side == "right":  # the completion's end first, then the prompt's end
            cut_first = np.minimum(excess, c_keep)
            c_keep, p_keep = c_keep - cut_first, p_keep - (excess - cut_first)
        else:  # the prompt's start first, then the completion's end
            cut_first = np.minimum(excess, p_keep)
            p_off, p_keep, c_keep = p_off + cut_first, p_keep - cut_first, c_keep - (excess - cut_first)
    return p_off, p_keep, c_keep


@dataclass(frozen=True)
class PromptCompletionLengths:
    """A split of prompt/completion rows as the planner plans it (``kinds.PromptCompletion.plan_lengths``): their
    cut depends on the strategy's limits (``Strategy.prompt_completion_limits``: packing that splits rows leaves
    ``max_length`` to the packer), so :meth:`at` cuts them per candidate as ``PromptCompletion.split_rows`` does."""

    prompt: np.ndarray  # [rows] prompt tokens
    completion: np.ndarray  # [rows] completion tokens
    completion_only_loss: bool = True

    @property
    def lengths(self) -> np.ndarray:
        """``[rows]`` whole token counts."""
        return np.asarray(self.prompt) + np.asarray(self.completion)

    def at(self, limits: PromptCompletionLimits) -> tuple[np.ndarray, int, int | None]:
        """``(row lengths, tokens lost, trained tokens or None: every token)`` under ``limits``; a row left with
        no completion is skipped, its prompt counted as lost."""
        _, p_keep, c_keep = prompt_completion_spans(self.prompt, self.completion, limits)
        kept = c_keep > 0
        rows = (p_keep + c_keep)[kept]
        trained = int(c_keep[kept].sum()) if self.completion_only_loss else None
        return rows, int(self.lengths.sum() - rows.sum()), trained
