"""``BatchingSettings``: every argument that decides how documents become rows and rows become batches.

One frozen, validated object: each field is documented where it is declared, every default and cross-field check is
resolved in ``__post_init__``, and the strategy objects, the planner and the resume signature all read it. Each
loader's strategy is an object holding only its own options (``options.py``: ``Pad``, ``Truncate``, ``Pack``); what
every strategy shares is here. Integer fields declare their minimum (``fields.integer``) instead of each being
checked by hand. No Lightning import.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from lightning_seqmem.batching.fields import check_flags, check_integers, decides_rows, integer
from lightning_seqmem.batching.options import Batching, Pad, as_batching
from lightning_seqmem.batching.truncation import (
    MIN_MAX_LENGTH,
    PromptCompletionLimits,
    check_part_limits,
    check_truncation_side,
)

SPLITS = ("train", "validation")


@dataclass(frozen=True)
class BatchingSettings:
    """How a split's documents become rows and batches (``SeqMemDataModule``'s batching arguments, same meaning):
    each loader's strategy with its own options (``batching``, ``eval_batching``: ``options.Pad``, ``Truncate``,
    ``Pack``) and what every strategy shares.

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
    max_tokens_per_batch: int | None = integer(None, 1, " or None", optional=True, signature=True)
    """Token budget (rows x padded length) per batch."""
    max_prompt_length: int | None = integer(None, 1, " or None", optional=True)
    """Prompt/completion data: keep the last this many prompt tokens."""
    max_completion_length: int | None = integer(None, 1, " or None", optional=True)
    """Prompt/completion data: keep the first this many completion tokens."""
    batching: Batching = Pad()
    """The training loader's strategy and its options (a shorthand name, ``"pack"``, becomes ``Pack()``)."""
    eval_batching: Batching | None = None
    """The validation loader's; ``None``: ``batching`` (see :meth:`batching_for`)."""
    truncation_side: str = "right"
    """``"right"`` keeps a long document's start, ``"left"`` its end."""
    truncation_mode: str | None = None
    """Preference pairs: how ``max_length`` cuts prompt + completion, TRL's ``"keep_start"`` or ``"keep_end"``;
    ``None``: from ``truncation_side`` (``"right"`` -> ``"keep_start"``, ``"left"`` -> ``"keep_end"``)."""
    completion_only_loss: bool = True
    """Prompt/completion data: labels -100 on the prompt."""
    drop_last: bool = decides_rows(False)
    """Drop the incomplete tail of a training epoch."""

    def __post_init__(self) -> None:
        check_integers(self)
        check_flags(self)
        object.__setattr__(self, "batching", as_batching(self.batching, "batching"))
        if self.eval_batching is not None:
            object.__setattr__(self, "eval_batching", as_batching(self.eval_batching, "eval_batching"))
        check_truncation_side(self.truncation_side)
        check_part_limits(self.max_prompt_length, self.max_completion_length)  # their sum: the kind checks
        if self.truncation_mode is not None:
            _ = self.preference_limits  # a known mode
        budget = self.max_tokens_per_batch
        fixed = [b for b in map(self.batching_for, SPLITS) if b.full_length_rows]
        if budget is not None and budget < self.max_length and fixed:
            raise ValueError(
                f"max_tokens_per_batch={budget} is smaller than one row of max_length={self.max_length} "
                f"tokens ({fixed[0].name} rows are always max_length long); set it to at least {self.max_length}."
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

    def batching_for(self, split: str) -> Batching:
        """The strategy options of ``split``'s loader (validation: ``eval_batching``, else ``batching``)."""
        return self.batching if split == "train" else self.eval_batching or self.batching

    def batch_size(self, split: str) -> int:
        """Rows per batch of ``split`` (validation: ``eval_batch_size``, else ``micro_batch_size``)."""
        return self.micro_batch_size if split == "train" else self.eval_batch_size or self.micro_batch_size

    def oversized_batch(self, rows: int) -> str | None:
        """A warning when ``micro_batch_size`` is larger than the ``rows`` the training split holds (a token budget
        decides its own rows): every epoch is then one batch of fewer rows than asked, and what was planned for
        ``micro_batch_size`` rows (memory, speed) is not what runs."""
        if self.max_tokens_per_batch is not None or rows >= self.micro_batch_size:
            return None
        return (
            f"train: micro_batch_size={self.micro_batch_size} is larger than the {rows:,} row(s) the split holds "
            f"(with batching={self.batching!r}): each epoch is one batch of {rows:,} rows, not "
            f"{self.micro_batch_size}, so memory and speed planned for {self.micro_batch_size} rows are not what runs. "
            f"Lower micro_batch_size to {rows:,} or fewer, or give more data."
        )

    def packs_any(self) -> bool:
        """Whether the train or the validation loader packs documents (packing is planned at ``prepare_data``)."""
        return any(self.batching_for(s).packs for s in SPLITS)

    def signature(self, default_overflow: str) -> dict[str, Any]:
        """What a saved loader position refers to: the fields declared to decide the train rows and batches, the
        train strategy's name and its own such options (``Pack``'s ``overflow`` resolved with the data kind's
        ``default_overflow``: ``kinds.Kind.signature`` asks)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("signature")}
        out.update(self.batching.signature())
        if self.batching.packs:
            out["overflow"] = self.batching.overflow_for(default_overflow)
        return out
