"""``BatchingSettings``: every argument that decides how documents become rows and rows become batches.

One frozen, validated object: each field is documented where it is declared, every default and cross-field check is
resolved in ``__post_init__``, and the strategy objects, the planner and the resume signature all read it. Integer
fields declare their minimum (``integer``) instead of each being checked by hand. No Lightning import.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from lightning_seqmem.batching.packed_rows import OVERFLOWS, check_packing
from lightning_seqmem.batching.strategies import STRATEGIES, strategy_class
from lightning_seqmem.batching.truncation import (
    MIN_MAX_LENGTH,
    PromptCompletionLimits,
    check_part_limits,
    check_truncation_side,
)
from lightning_seqmem.messages import short_repr

SPLITS = ("train", "validation")


def integer(default: Any, minimum: int, hint: str = "", optional: bool = False, signature: bool = False):
    """A dataclass field holding an ``int >= minimum`` (any integral number is accepted and stored as ``int``);
    ``optional``: ``None`` is allowed too. ``signature``: the field decides the train rows and batches (resume)."""
    return field(
        default=default, metadata={"minimum": minimum, "hint": hint, "optional": optional, "signature": signature}
    )


def decides_rows(default: Any):
    """A field (not an integer) that decides the train rows and batches: part of ``signature()``."""
    return field(default=default, metadata={"signature": True})


def check_integers(settings: Any) -> None:
    """Check (and store as ``int``) every field declared with :func:`integer`; ``ValueError`` names the rule."""
    for f in fields(settings):
        if "minimum" not in f.metadata:
            continue
        value, minimum = getattr(settings, f.name), f.metadata["minimum"]
        if value is None and f.metadata["optional"]:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
            raise ValueError(f"{f.name} must be an int >= {minimum}{f.metadata['hint']}, got {short_repr(value)}.")
        object.__setattr__(settings, f.name, int(value))


def check_flags(settings: Any) -> None:
    """Refuse a field annotated ``bool`` holding anything but ``True``/``False`` (a string such as ``"false"``
    would switch the option on); ``ValueError`` names the field."""
    for f in fields(settings):
        value = getattr(settings, f.name)
        if f.type in ("bool", bool) and not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{f.name} must be True or False, got {short_repr(value)}.")


@dataclass(frozen=True)
class BatchingSettings:
    """How a split's documents become rows and batches (``SeqMemDataModule``'s batching arguments, same meaning).

    Raises:
        ValueError: a value outside its range or choices, or settings that contradict each other; the message
            names the fix.
    """

    max_length: int = integer(512, MIN_MAX_LENGTH, " (a row needs an input and a target)", signature=True)
    """Longest row fed to the model, in tokens."""
    micro_batch_size: int = integer(8, 1, signature=True)
    """Rows per training batch on each device (before gradient accumulation)."""
    eval_batch_size: int | None = integer(None, 1, " or None (= micro_batch_size)", optional=True)
    """Rows per validation batch; ``None``: ``micro_batch_size`` (see :meth:`batch_size`)."""
    seed: int = integer(42, 0, signature=True)
    """Seeds shuffling (epoch ``e`` uses ``seed + e``) and the validation split."""
    pad_to_multiple_of: int | None = integer(8, 1, " or None", optional=True)
    """Padded length rounded up to this; ``None`` to disable."""
    max_tokens_per_batch: int | None = integer(None, 1, " or None", optional=True, signature=True)
    """Token budget (rows x padded length) per batch."""
    max_prompt_length: int | None = integer(None, 1, " or None", optional=True)
    """Prompt/completion data: keep the last this many prompt tokens."""
    max_completion_length: int | None = integer(None, 1, " or None", optional=True)
    """Prompt/completion data: keep the first this many completion tokens."""
    strategy: str = decides_rows("pad")
    """``"pad"``, ``"truncate"`` or ``"pack"``: the training loader's strategy."""
    eval_strategy: str | None = None
    """The validation loader's strategy; ``None``: ``strategy`` (see :meth:`strategy_for`)."""
    packing: str = decides_rows("bfd")
    """``"bfd"`` or ``"wrapped"`` (``pack`` only)."""
    overflow: str | None = decides_rows(None)
    """``pack`` with a document over ``max_length``; ``None``: resolved per data kind by :meth:`overflow_for`."""
    allow_split_prompt_completion: bool = False
    """With ``overflow="split"``, split prompt/completion rows too (later pieces lose their prompt)."""
    group_by_length: bool = decides_rows(False)
    """``pad`` only: batches of similar lengths."""
    pad_to_max_length: bool = False
    """``pad`` only: every batch ``[rows, max_length]``."""
    truncation_side: str = "right"
    """``"right"`` keeps a long document's start, ``"left"`` its end."""
    truncation_mode: str | None = None
    """Preference pairs: how ``max_length`` cuts prompt + completion, TRL's ``"keep_start"`` or ``"keep_end"``;
    ``None``: from ``truncation_side`` (``"right"`` -> ``"keep_start"``, ``"left"`` -> ``"keep_end"``)."""
    completion_only_loss: bool = True
    """Prompt/completion data: labels -100 on the prompt."""
    return_cu_seqlens: bool = False
    """``pack`` only: also yield ``cu_seqlens``."""
    drop_last: bool = decides_rows(False)
    """Drop the incomplete tail of a training epoch."""

    def __post_init__(self) -> None:
        check_integers(self)
        check_flags(self)
        for name, value in (("strategy", self.strategy), ("eval_strategy", self.strategy_for("validation"))):
            if value not in STRATEGIES:
                raise ValueError(f"Unknown {name} {value!r}; choose one of {list(STRATEGIES)}.")
        if self.overflow is not None and self.overflow not in OVERFLOWS:
            raise ValueError(
                f"overflow={self.overflow!r} is not valid; use one of {OVERFLOWS} (or None: split text, "
                "truncate prompt/completion rows)."
            )
        check_packing(self.packing, self.overflow or "split")
        check_truncation_side(self.truncation_side)
        check_part_limits(self.max_prompt_length, self.max_completion_length)  # their sum: check_kind
        if self.truncation_mode is not None:
            _ = self.preference_limits  # a known mode
        budget, fixed = (
            self.max_tokens_per_batch,
            [strategy_class(self.strategy_for(s)).full_length_rows for s in SPLITS],
        )
        if budget is not None and budget < self.max_length and any(fixed):
            raise ValueError(
                f"max_tokens_per_batch={budget} is smaller than one row of max_length={self.max_length} "
                f"tokens (strategy={self.strategy!r} rows are always max_length long); set it to at least "
                f"{self.max_length}."
            )

    @property
    def limits(self) -> PromptCompletionLimits:
        """The prompt/completion truncation limits (validated)."""
        return PromptCompletionLimits(
            self.max_length, self.max_prompt_length, self.max_completion_length, self.truncation_side
        )

    @property
    def preference_limits(self):
        """The preference-pair truncation limits (``batching.preference.PreferenceLimits``, validated): TRL's
        two stages with ``max_prompt_length``, ``max_completion_length``, then ``max_length``."""
        from lightning_seqmem.batching.preference import PreferenceLimits

        mode = self.truncation_mode or ("keep_start" if self.truncation_side == "right" else "keep_end")
        return PreferenceLimits(self.max_length, self.max_prompt_length, self.max_completion_length, mode)

    def strategy_for(self, split: str) -> str:
        """The strategy name of ``split``'s loader (validation: ``eval_strategy``, else ``strategy``)."""
        return self.strategy if split == "train" else self.eval_strategy or self.strategy

    def batch_size(self, split: str) -> int:
        """Rows per batch of ``split`` (validation: ``eval_batch_size``, else ``micro_batch_size``)."""
        return self.micro_batch_size if split == "train" else self.eval_batch_size or self.micro_batch_size

    def overflow_for(self, kind: str) -> str:
        """The overflow rule for data of ``kind``: the argument, else ``"split"`` for text and ``"truncate"`` for
        prompt/completion rows (a piece of an SFT example without its prompt would train on an answer to nothing)."""
        if self.overflow is not None:
            return self.overflow
        # Conversations arrive already cut to max_length by whole turns (``conversation_rows``): never split.
        return "truncate" if kind in ("prompt_completion", "conversations") else "split"

    def packs_any(self) -> bool:
        """Whether the train or the validation loader packs documents (packing is planned at ``prepare_data``)."""
        return any(strategy_class(self.strategy_for(s)).packs for s in SPLITS)

    def check_kind(self, kind: str) -> None:
        """Refuse settings that do not suit data of ``kind`` (known only once the data are read): prompt/completion
        rows must fit ``max_length`` after the per-part limits, while preference pairs take TRL's third stage
        (``max_length`` over prompt + completion) after them."""
        if kind == "prompt_completion":
            _ = self.limits  # max_prompt_length + max_completion_length must fit max_length
        if kind == "conversations" and self.packing == "wrapped" and self.packs_any():
            raise ValueError(
                "packing='wrapped' cuts rows at max_length wherever a conversation ends, and a piece of a "
                "conversation without its start would be trained on without its context. Use packing='bfd' "
                "(conversations packed whole)."
            )
        if (
            kind == "prompt_completion"
            and self.overflow == "split"
            and not self.allow_split_prompt_completion
            and self.packs_any()
        ):
            raise ValueError(
                "overflow='split' would cut long prompt/completion rows into pieces, and every piece after the "
                "first would train on completion tokens without their prompt. Leave overflow=None (truncate: keep "
                "the prompt's end and the completion's start), or pass allow_split_prompt_completion=True to "
                "split anyway."
            )

    def signature(self, kind: str) -> dict[str, Any]:
        """The fields declared to decide the train rows and batches (``overflow`` resolved for ``kind``): what a
        saved loader position refers to, with these key names (checkpoints keep them)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("signature")}
        return dict(out, overflow=self.overflow_for(kind))
