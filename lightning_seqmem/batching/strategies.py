"""Batching strategies: pad, truncate, pack. Chosen once; each answers every question about its batches.

A strategy turns a split's documents (a ``tokens.TokenSource`` plus optional per-token labels) into rows the
model sees, and says how to batch them: ``rows`` (rows, real tokens per row, what was cut; ``row_lengths`` the
same from document lengths alone), ``collator``, ``sampler``/``split_sampler``, ``keys``, ``shapes`` (``(rows,
length)`` of every batch, from lengths alone), ``epoch_stats``, and for checks and reports ``label``,
``constant_shapes`` and ``packs``. Built from frozen ``BatchingSettings`` and the split's options object
(``options.Pad``, ``Truncate``, ``Pack``: ``make_strategy``) once the data kind is known, and never changed. No
Lightning import; ``SeqMemDataModule`` holds one strategy per split (``eval_batching`` may differ from training) and
``seqmem-plan`` asks the same objects, so the planner's numbers are the DataModule's by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from torch.utils.data import Dataset

from lightning_seqmem.batch import CU_SEQLENS, PACK_KEYS, PAD_KEYS, full_rows, packed_rows, padded_rows
from lightning_seqmem.batching.batch_list import BatchList
from lightning_seqmem.batching.collate import PackCollator, PadCollator, TruncateCollator
from lightning_seqmem.batching.options import Batching, Pack, Pad, Truncate
from lightning_seqmem.batching.packed_rows import PackResult, pack_lengths
from lightning_seqmem.batching.plan_cache import cached_pack_lengths
from lightning_seqmem.batching.sampling import (
    LengthGroupedSampler,
    ShuffledBatchSampler,
    TokenBudgetBatchSampler,
)
from lightning_seqmem.batching.truncation import PromptCompletionLimits, count_truncated
from lightning_seqmem.data.tokens import as_token_source


class Strategy(Protocol):
    """What ``SeqMemDataModule``, the planner and the checks ask a split's strategy (pad, truncate and pack answer)."""

    options: Batching  # what it was built from: ``Pad(...)``, ``Truncate()``, ``Pack(...)``
    name: str  # the shorthand that selects it (for messages)
    packs: bool  # several documents per row
    full_length_rows: bool  # every row is ``max_length`` long (a token budget then fixes the rows per batch)

    @property
    def label(self) -> str: ...  # for reports, in the batching vocabulary: "pad", "truncate", "pack_bfd"

    @property
    def keys(self) -> tuple[str, ...]: ...

    @property
    def constant_shapes(self) -> bool: ...  # every batch one shape: the CUDA allocator reuses its blocks

    @property
    def budget_shapes(self) -> bool: ...  # rows and length vary together (a token budget on padded batches)

    @property
    def row_planner(self) -> Any: ...  # the strategy whose sampler batches this one's rows (``mixed_sampler``)

    @property
    def prompt_completion_limits(self) -> PromptCompletionLimits: ...

    def rows(self, source: Any, labels: Any = None) -> SplitRows: ...

    def row_lengths(self, lengths: np.ndarray) -> tuple[np.ndarray, dict[str, int]]: ...

    def collator(self, pad_token_id: int): ...

    def rows_per_batch(self, split: str) -> int: ...

    def split_sampler(
        self, lengths: np.ndarray, split: str, num_replicas: int | None = None, rank: int | None = None
    ): ...

    def epoch_stats(self, lengths: np.ndarray, sampler) -> EpochStats: ...

    def worst_layout(self, rows: int, length: int, lengths: np.ndarray | None = None): ...

    def lost_tokens_fix(self, prompt_completion: bool) -> str: ...


class DocumentRows(Dataset):
    """Row ``i`` is document ``i``: ``{"input_ids"[, "labels"]}`` numpy arrays gathered on demand (views)."""

    def __init__(self, source: Any, labels: Any = None) -> None:
        self.source, self.labels = source, labels

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        out = {"input_ids": self.source.row(i)}
        if self.labels is not None:
            out["labels"] = self.labels.row(i)
        return out


class PackedRows(Dataset):
    """Row ``i`` of a ``PackResult`` as ``{"input_ids", "seq_lengths"[, "labels"]}`` (what ``PackCollator`` takes)."""

    def __init__(self, packed: PackResult, labels: Any = None) -> None:
        self.packed, self.labels = packed, labels

    def __len__(self) -> int:
        return self.packed.num_rows

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return self.packed.row_arrays(i, self.labels)


@dataclass
class SplitRows:
    """A split after its strategy: the rows served, real tokens per row, and counts of what was cut."""

    rows: Dataset
    lengths: np.ndarray  # [rows] real tokens per row fed to the model
    stats: dict[str, int]


@dataclass(frozen=True)
class EpochStats:
    """Epoch 0 of a split on one process, from its row lengths: what ``SeqMemDataModule.stats()`` reports per split
    (``counts()``) and the batch shape to pre-allocate for."""

    rows: int
    batches: int
    rows_dropped_per_epoch: int  # left out by ``drop_last``
    token_efficiency: float  # real tokens / slots fed to the model
    largest: tuple[int, int] | None  # (rows, length) of the largest batch (``strategy.largest``); None: no batch

    def counts(self) -> dict[str, float]:
        return {
            "rows": self.rows,
            "batches": self.batches,
            "rows_dropped_per_epoch": self.rows_dropped_per_epoch,
            "token_efficiency": self.token_efficiency,
        }


class PadStrategy:
    """Each batch padded to its longest row (rounded up to ``Pad.to_multiple_of``), rows cut at ``max_length``.

    Args:
        settings: the frozen ``BatchingSettings`` (read, never changed): what every strategy shares.
        options: this split's strategy options (``Pad``; ``Truncate``/``Pack`` for the subclasses).
        default_overflow: the data kind's overflow rule (``kinds.Kind.default_overflow``), used by ``Pack`` options
            that leave ``overflow`` unset.
        plan_cache: where packing plans of large datasets are kept (``plan_cache``); ``None``: not cached.
    """

    def __init__(
        self, settings: Any, options: Batching, default_overflow: str = "split", plan_cache: str | None = None
    ) -> None:
        self.settings, self.options, self.plan_cache = settings, options, plan_cache
        self.name, self.packs, self.full_length_rows = options.name, options.packs, options.full_length_rows
        self._shape_collator = None

    @property
    def label(self) -> str:
        return self.options.label

    @property
    def keys(self) -> tuple[str, ...]:
        return PAD_KEYS

    @property
    def constant_shapes(self) -> bool:
        """Rows of ``max_length`` always, or padded to it (``Pad.to_max_length``) with no token budget."""
        return self.full_length_rows or (self.options.to_max_length and self.settings.max_tokens_per_batch is None)

    @property
    def row_planner(self) -> PadStrategy:
        """Itself: its sampler batches its rows (rows per batch, token budget, padded lengths)."""
        return self

    @property
    def budget_shapes(self) -> bool:
        """Whether rows and length vary together (a token budget on padded batches): the largest batch is then the
        one with the most slots, not the largest rows and the largest length apart."""
        return not self.full_length_rows and self.settings.max_tokens_per_batch is not None

    @property
    def prompt_completion_limits(self) -> PromptCompletionLimits:
        """The limits applied at dataset level to prompt/completion rows (all of them: rows fit ``max_length``)."""
        return self.settings.limits

    def rows(self, source: Any, labels: Any = None) -> SplitRows:
        return SplitRows(DocumentRows(source, labels), *self.row_lengths(source.lengths))

    def row_lengths(self, lengths: np.ndarray) -> tuple[np.ndarray, dict[str, int]]:
        """``([rows] real tokens per row, counts of what was cut)`` from ``[documents]`` lengths alone."""
        m = self.settings.max_length
        return np.minimum(lengths, m), {"tokens_truncated": count_truncated(lengths, m)}

    def lost_tokens_fix(self, prompt_completion: bool) -> str:
        """How to keep the tokens this strategy cut (the end of the DataModule's warning)."""
        return "Raise max_length, or use batching=Pack(overflow='split') to keep them."

    def collator(self, pad_token_id: int):
        s, o = self.settings, self.options
        return PadCollator(
            pad_token_id,
            max_length=s.max_length,
            pad_to_multiple_of=o.to_multiple_of,
            pad_to_max_length=o.to_max_length,
            truncation_side=s.truncation_side,
        )

    def padded_length(self, longest: int) -> int:
        """The ``seq`` of a batch whose longest row has ``longest`` tokens (asked once per batch by samplers)."""
        if self._shape_collator is None:
            self._shape_collator = self.collator(0)
        return self._shape_collator.padded_length(longest)

    def rows_per_batch(self, split: str) -> int:
        """Rows of ``split``'s batches (a ``pad`` token budget varies them: this is the cap without one)."""
        return self._rows(self.settings.batch_size(split))

    def _rows(self, batch_size: int) -> int:
        return batch_size

    def sampler(self, lengths: np.ndarray, batch_size: int, **common):
        s = self.settings
        if s.max_tokens_per_batch is not None:
            return TokenBudgetBatchSampler(lengths, s.max_tokens_per_batch, padded_length=self.padded_length, **common)
        if self.options.group_by_length:
            return LengthGroupedSampler(lengths, batch_size, **common)
        return ShuffledBatchSampler(len(lengths), batch_size, **common)

    def split_sampler(self, lengths: np.ndarray, split: str, num_replicas: int | None = None, rank: int | None = None):
        """``split``'s sampler: train shuffles (``seed + epoch``) and honours ``drop_last``; validation keeps order
        and every row."""
        train = split == "train"
        return self.sampler(
            lengths,
            self.settings.batch_size(split),
            shuffle=train,
            seed=self.settings.seed,
            num_replicas=num_replicas,
            rank=rank,
            drop_last=self.settings.drop_last and train,
        )

    def shapes(self, batches: BatchList, lengths: np.ndarray) -> list[tuple[int, int]]:
        """``(rows, length)`` of each batch."""
        batches = _as_batch_list(batches)
        longest = batches.reduce(lengths, np.maximum).tolist()
        return [(rows, self.padded_length(int(n))) for rows, n in zip(batches.sizes.tolist(), longest)]

    def epoch_stats(self, lengths: np.ndarray, sampler) -> EpochStats:
        """Epoch 0 of ``sampler`` (one process) over rows of ``[rows]`` real tokens: batches, rows dropped, real
        tokens / slots and the largest batch. ``SeqMemDataModule`` and ``seqmem-plan`` both report this."""
        batches = _as_batch_list(sampler.batches(0))
        shapes = self.shapes(batches, lengths)
        fed = int(batches.reduce(np.asarray(lengths, dtype=np.int64), np.add).sum())
        return EpochStats(
            rows=len(lengths),
            batches=len(shapes),
            rows_dropped_per_epoch=sampler.num_dropped,
            token_efficiency=fed / max(sum(r * n for r, n in shapes), 1),
            largest=self.largest(shapes) if shapes else None,
        )

    def largest(self, shapes: list[tuple[int, int]]) -> tuple[int, int]:
        """The shape to pre-allocate for: with a token budget rows and length vary together (most slots)."""
        return largest_shape([self], shapes)

    def worst_layout(self, rows: int, length: int, lengths: np.ndarray | None = None) -> tuple[tuple[int, ...], ...]:
        """Document lengths per row of the costliest ``[rows, length]`` batch, from ``[rows]`` real tokens per row:
        a padded row (transformers then builds the attention mask) unless no batch can hold padding."""
        if lengths is not None and len(lengths) and self._never_padded(int(np.min(lengths)), int(np.max(lengths))):
            return full_rows(rows, length)
        return padded_rows(rows, length)

    def _never_padded(self, shortest: int, longest: int) -> bool:
        return shortest == longest and self.padded_length(longest) == longest


class TruncateStrategy(PadStrategy):
    """Every row cut and padded to ``max_length``: one constant shape ``[rows, max_length]`` (a budget fixes the
    rows)."""

    def collator(self, pad_token_id: int):
        s = self.settings
        return TruncateCollator(pad_token_id, s.max_length, truncation_side=s.truncation_side)

    def _rows(self, batch_size: int) -> int:
        budget = self.settings.max_tokens_per_batch
        return batch_size if budget is None else budget // self.settings.max_length

    def sampler(self, lengths: np.ndarray, batch_size: int, **common):
        return ShuffledBatchSampler(len(lengths), self._rows(batch_size), **common)

    def shapes(self, batches: BatchList, lengths: np.ndarray) -> list[tuple[int, int]]:
        return [(rows, self.settings.max_length) for rows in _as_batch_list(batches).sizes.tolist()]

    def _never_padded(self, shortest: int, longest: int) -> bool:
        return shortest >= self.settings.max_length


class PackStrategy(TruncateStrategy):
    """Documents packed into ``max_length`` rows once per split (epochs reshuffle rows, never re-pack); the
    ``Pack`` options' ``overflow`` resolved with the data kind's default (``overflow``)."""

    def __init__(
        self, settings: Any, options: Pack, default_overflow: str = "split", plan_cache: str | None = None
    ) -> None:
        super().__init__(settings, options, default_overflow, plan_cache)
        self.overflow = options.overflow_for(default_overflow)

    @property
    def keys(self) -> tuple[str, ...]:
        return PACK_KEYS + ((CU_SEQLENS,) if self.options.cu_seqlens else ())

    @property
    def prompt_completion_limits(self) -> PromptCompletionLimits:
        """``overflow="truncate"`` (the prompt/completion default): the full limits, so every row fits a row and
        keeps its prompt's end and its completion's start; otherwise only the per-part limits (overflow decides)."""
        limits = self.settings.limits
        if self.overflow == "truncate":
            return limits
        return PromptCompletionLimits(None, limits.max_prompt_length, limits.max_completion_length)

    def rows(self, source: Any, labels: Any = None) -> SplitRows:
        s = self.settings
        # ``pack_sequences`` without a separator token, its plan planned once per node and mapped from disk
        source = as_token_source(source)
        packed = cached_pack_lengths(source.lengths, s.max_length, self.options.method, self.overflow, self.plan_cache)
        packed.source = source
        return SplitRows(PackedRows(packed, labels), *self._rows_and_cuts(packed))

    def row_lengths(self, lengths: np.ndarray) -> tuple[np.ndarray, dict[str, int]]:
        return self._rows_and_cuts(pack_lengths(lengths, self.settings.max_length, self.options.method, self.overflow))

    def lost_tokens_fix(self, prompt_completion: bool) -> str:
        if prompt_completion:
            return "Raise max_length, or max_prompt_length / max_completion_length, to keep them."
        if self.overflow != "split":
            return "Use batching=Pack(overflow='split') to keep them (a long document becomes max_length pieces)."
        return "Raise max_prompt_length / max_completion_length to keep them."

    @staticmethod
    def _rows_and_cuts(packed: PackResult) -> tuple[np.ndarray, dict[str, int]]:
        s = packed.stats()
        return np.diff(packed.row_offsets), {k: s[k] for k in ("tokens_truncated", "tokens_dropped", "documents_split")}

    def worst_layout(self, rows: int, length: int, lengths: np.ndarray | None = None) -> tuple[tuple[int, ...], ...]:
        """Two documents in every row (the block-diagonal mask transformers builds from restarting position_ids):
        row lengths alone do not tell whether a full row holds one document or several."""
        return packed_rows(rows, length)

    def collator(self, pad_token_id: int):
        return PackCollator(pad_token_id, self.settings.max_length, return_cu_seqlens=self.options.cu_seqlens)


def _as_batch_list(batches) -> BatchList:
    """A sampler's batches as a ``BatchList`` (a user's sampler may give plain lists of indices)."""
    if isinstance(batches, BatchList):
        return batches
    sizes = [len(b) for b in batches]
    order = np.fromiter((i for b in batches for i in b), dtype=np.int64, count=sum(sizes))
    return BatchList.cut(order, sizes)


_RUNTIME: dict[type[Batching], type[PadStrategy]] = {Pad: PadStrategy, Truncate: TruncateStrategy, Pack: PackStrategy}


def make_strategy(
    settings: Any, split: str = "train", default_overflow: str = "split", plan_cache: str | None = None
) -> Strategy:
    """The strategy object of ``split``'s loader under ``settings`` (``BatchingSettings``: its options are
    ``settings.batching_for(split)``) for documents whose kind's overflow rule is ``default_overflow`` (a data
    kind asks through ``kinds.Kind.strategy``)."""
    options = settings.batching_for(split)
    return _RUNTIME[type(options)](settings, options, default_overflow, plan_cache)


def largest_shape(strategies: list[Strategy], largest: list[tuple[int, int]]) -> tuple[int, int]:
    """The shape to pre-allocate for across splits, from each split's ``largest``: with a token budget on a ``pad``
    split rows and length vary together (the shape with the most slots), else the largest rows and length."""
    if any(s.budget_shapes for s in strategies):
        return max(largest, key=lambda s: (s[0] * s[1], s[1]))
    return max(s[0] for s in largest), max(s[1] for s in largest)
