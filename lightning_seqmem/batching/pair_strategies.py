"""Batching strategies for preference pairs: padded pairs (``pad``/``truncate``) and padding-free pairs (``pack``).

They answer the questions of ``strategies.Strategy`` for pair data, so the DataModule, ``stats()``,
``max_batch_shape()`` and the pre-allocator treat pairs like any other split. Two facts differ from documents:

- A padded pair batch of ``B`` pairs is ``[2B, L]`` (TRL's layout: chosen rows, then rejected rows), ``L`` padded
  from the longest of its ``2B`` sequences. Row lengths are therefore ``[pairs, 2]`` (each side's truncated
  sequence); the sampler sees the longer side, and a token budget counts both rows of a pair.
- Packed pairs are whole pairs best-fit into rows of ``2 * max_length`` (``pair_packing``): ``B`` rows have the
  slots of TRL's ``[2B, max_length]`` batch and a pair never straddles two rows, micro-batches or ranks.

Which one a split gets follows the strategy class's own answers (``packs``, ``full_length_rows``), never its name.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from lightning_seqmem.batch import CU_SEQLENS, PREFERENCE_PACK_KEYS, PREFERENCE_PAD_KEYS, packed_rows
from lightning_seqmem.batching.options import Pad
from lightning_seqmem.batching.pair_collate import PreferenceCollator
from lightning_seqmem.batching.pair_packing import PackedPairCollator, plan_pair_rows
from lightning_seqmem.batching.pair_rows import PackedPairRows, PairRows, PairSource
from lightning_seqmem.batching.preference import PairSpans, preference_spans
from lightning_seqmem.batching.sampling import ShuffledBatchSampler
from lightning_seqmem.batching.strategies import (
    EpochStats,
    SplitRows,
    _as_batch_list,
    largest_shape,
    make_strategy,
)

_FIX = "Raise max_length, or max_prompt_length / max_completion_length, to keep them."


def pair_cuts(lengths: np.ndarray, limits: Any) -> tuple[PairSpans, dict[str, int]]:
    """The planner's view of a split's pairs: spans and counts from ``[pairs, 3]`` (prompt, chosen, rejected)
    token counts, as ``pair_rows.plan_pairs`` counts them (a prompt counts once per sequence; pairs left without
    a completion are dropped)."""
    p, c, r = np.asarray(lengths, dtype=np.int64).reshape(-1, 3).T
    spans = preference_spans(p, c, r, limits)
    counts = spans.dropped()
    return spans, {
        "tokens": int((2 * p + c + r).sum()),
        "tokens_truncated": counts["tokens_truncated"],
        "tokens_dropped": int(spans.sequence_lengths[:, spans.lost].sum()),
    }


def _epoch_stats(strategy: Any, lengths: np.ndarray, sampler, shapes) -> EpochStats:
    """Epoch 0 of ``sampler`` from ``[rows]`` (or ``[pairs, 2]``) real tokens and the batches' shapes."""
    batches = _as_batch_list(sampler.batches(0))
    shapes = shapes(batches)
    real = np.asarray(lengths, dtype=np.int64).reshape(len(lengths), -1).sum(axis=1)
    fed = int(batches.reduce(real, np.add).sum()) if len(batches) else 0
    return EpochStats(
        rows=len(lengths),
        batches=len(shapes),
        rows_dropped_per_epoch=sampler.num_dropped,
        token_efficiency=fed / max(sum(r * n for r, n in shapes), 1),
        largest=largest_shape([strategy], shapes) if shapes else None,
    )


class _PairLimits:
    """The limits both pair strategies answer from their settings alone."""

    settings: Any

    @property
    def prompt_completion_limits(self):
        """Asked of prompt/completion data only (the pipeline never asks it for pairs)."""
        return self.settings.limits

    @property
    def pair_limits(self):
        """The pairs' truncation (``BatchingSettings.preference_limits``): what ``plan_pairs`` counts and the
        collator cuts."""
        return self.settings.preference_limits


class PairPadStrategy(_PairLimits):
    """Pairs padded in TRL's layout: ``pad`` (to the batch's longest sequence) or ``truncate`` (always
    ``[2B, max_length]``). The document strategy of the same name owns batch sizes, samplers and padded lengths;
    this object asks it about pairs (the longer side of each) and doubles the rows.

    Args:
        settings: the frozen ``BatchingSettings``.
        split: ``"train"`` or ``"validation"`` (its strategy options, ``Pad`` or ``Truncate``, and batch size).
        plan_cache: unused (pairs are planned on lengths in memory); kept for ``make_strategy``'s signature.
    """

    packs = False

    def __init__(self, settings: Any, split: str = "train", plan_cache: str | None = None) -> None:
        self.settings = settings
        budget = settings.max_tokens_per_batch
        # A budget counts slots: both rows of a pair. The document strategy plans pairs (one row each), so it gets
        # half the budget (its rows x padded length <= budget / 2).
        inner = replace(settings, max_tokens_per_batch=budget // 2) if budget is not None else settings
        self._documents = make_strategy(inner, split, plan_cache=plan_cache)
        self.options, self.name = self._documents.options, self._documents.name
        self.full_length_rows = self._documents.full_length_rows

    @property
    def label(self) -> str:
        return f"{self.options.spelling} (pairs)"

    @property
    def keys(self) -> tuple[str, ...]:
        return PREFERENCE_PAD_KEYS

    @property
    def constant_shapes(self) -> bool:
        return self._documents.constant_shapes

    @property
    def budget_shapes(self) -> bool:
        return self._documents.budget_shapes

    @property
    def row_planner(self) -> Any:
        """The document strategy: it batches the pairs one row each (by the longer side, half the token budget),
        as ``split_sampler`` has it do; ``rows_per_batch`` here counts a pair's two rows."""
        return self._documents

    def rows(self, source: PairSource, labels: Any = None) -> SplitRows:
        """One row per pair; lengths ``[pairs, 2]`` (each side's truncated sequence)."""
        return SplitRows(PairRows(source), np.ascontiguousarray(source.sequence_lengths.T), {})

    def row_lengths(self, lengths: np.ndarray) -> tuple[np.ndarray, dict[str, int]]:
        """From ``[pairs, 3]`` prompt/chosen/rejected token counts alone (the planner): ``[pairs, 2]`` truncated
        sequence lengths of the pairs kept, and the counts of what was cut."""
        spans, cuts = pair_cuts(lengths, self.pair_limits)
        return np.ascontiguousarray(spans.sequence_lengths[:, ~spans.lost].T), cuts

    def collator(self, pad_token_id: int) -> PreferenceCollator:
        s = self.settings
        return PreferenceCollator(
            pad_token_id,
            s.preference_limits,
            pad_to_multiple_of=self.options.to_multiple_of if isinstance(self.options, Pad) else None,
            pad_to_max_length=self.constant_shapes and not self.budget_shapes,
        )

    def rows_per_batch(self, split: str) -> int:
        return 2 * self._documents.rows_per_batch(split)

    def split_sampler(self, lengths: np.ndarray, split: str, num_replicas: int | None = None, rank: int | None = None):
        return self._documents.split_sampler(_longer_side(lengths), split, num_replicas, rank)

    def epoch_stats(self, lengths: np.ndarray, sampler) -> EpochStats:
        longer = _longer_side(lengths)
        return _epoch_stats(
            self,
            lengths,
            sampler,
            lambda batches: [(2 * rows, length) for rows, length in self._documents.shapes(batches, longer)],
        )

    def worst_layout(self, rows: int, length: int, lengths: np.ndarray | None = None):
        flat = None if lengths is None else np.asarray(lengths).reshape(-1)
        return self._documents.worst_layout(rows, length, flat)

    def lost_tokens_fix(self, prompt_completion: bool) -> str:
        return _FIX


class PairPackStrategy(_PairLimits):
    """Padding-free pairs: whole pairs best-fit into rows of ``2 * max_length`` tokens, every batch
    ``[B, 2 * max_length]`` (``B`` rows hold the slots of TRL's ``[2B, max_length]``).

    Args:
        settings: the frozen ``BatchingSettings`` (a token budget gives ``budget // (2 * max_length)`` rows).
        split: ``"train"`` or ``"validation"`` (its ``Pack`` options: ``cu_seqlens``; pairs are always best fit).
        plan_cache: unused (the plan is best fit on ``[pairs]`` lengths, in memory).
    """

    name = "pack"
    packs = True
    full_length_rows = True
    constant_shapes = True
    budget_shapes = False

    def __init__(self, settings: Any, split: str = "train", plan_cache: str | None = None) -> None:
        self.settings, self.options = settings, settings.batching_for(split)
        self.row_length = 2 * settings.max_length

    @property
    def row_planner(self) -> PairPackStrategy:
        """Itself: a packed row of pairs is one row of its batches."""
        return self

    @property
    def label(self) -> str:
        return f"{self.options.spelling} (pairs)"  # pairs are always packed best fit: Pack(method="bfd")

    @property
    def keys(self) -> tuple[str, ...]:
        return PREFERENCE_PACK_KEYS + ((CU_SEQLENS,) if self.options.cu_seqlens else ())

    def rows(self, source: PairSource, labels: Any = None) -> SplitRows:
        """Rows of whole pairs (best fit on the pair lengths); lengths ``[rows]`` real tokens per packed row."""
        pairs, offsets, lengths = self._plan(source.pair_lengths)
        return SplitRows(PackedPairRows(source, pairs, offsets), lengths, {})

    def row_lengths(self, lengths: np.ndarray) -> tuple[np.ndarray, dict[str, int]]:
        """From ``[pairs, 3]`` prompt/chosen/rejected token counts alone (the planner): ``[rows]`` real tokens per
        packed row, and the counts of what was cut."""
        spans, cuts = pair_cuts(lengths, self.pair_limits)
        return self._plan(spans.pair_lengths[~spans.lost])[2], cuts

    def _plan(self, pair_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(pairs, offsets, [rows] real tokens)`` of whole pairs best-fit into rows (``plan_pair_rows``)."""
        pairs, offsets = plan_pair_rows(pair_lengths, self.row_length)
        lengths = np.add.reduceat(pair_lengths[pairs], offsets[:-1]) if len(pairs) else np.zeros(0, np.int64)
        return pairs, offsets, lengths.astype(np.int64)

    def collator(self, pad_token_id: int) -> PackedPairCollator:
        return PackedPairCollator(
            pad_token_id, self.settings.preference_limits, self.row_length, return_cu_seqlens=self.options.cu_seqlens
        )

    def rows_per_batch(self, split: str) -> int:
        budget = self.settings.max_tokens_per_batch
        return self.settings.batch_size(split) if budget is None else max(1, budget // self.row_length)

    def split_sampler(self, lengths: np.ndarray, split: str, num_replicas: int | None = None, rank: int | None = None):
        train, s = split == "train", self.settings
        return ShuffledBatchSampler(
            len(lengths),
            self.rows_per_batch(split),
            shuffle=train,
            seed=s.seed,
            num_replicas=num_replicas,
            rank=rank,
            drop_last=s.drop_last and train,
        )

    def epoch_stats(self, lengths: np.ndarray, sampler) -> EpochStats:
        return _epoch_stats(
            self, lengths, sampler, lambda batches: [(rows, self.row_length) for rows in batches.sizes.tolist()]
        )

    def worst_layout(self, rows: int, length: int, lengths: np.ndarray | None = None):
        """Several sequences in every row (at least a pair's two)."""
        return packed_rows(rows, length)

    def lost_tokens_fix(self, prompt_completion: bool) -> str:
        return _FIX


def _longer_side(lengths: np.ndarray) -> np.ndarray:
    """``[pairs]`` the longer truncated sequence of each pair (what padding a batch of pairs sees)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return lengths.max(axis=1) if lengths.ndim == 2 else lengths


def make_pair_strategy(settings: Any, split: str = "train", plan_cache: str | None = None):
    """The strategy object of ``split``'s loader for preference pairs: packed pairs where the document strategy
    packs, padded pairs otherwise."""
    packs = settings.batching_for(split).packs
    return (PairPackStrategy if packs else PairPadStrategy)(settings, split, plan_cache)
