"""Batching strategies: pad, truncate, pack. Chosen once; each owns its rows, collator, sampler, keys and shapes.

A strategy turns a split's documents (a ``tokens.TokenSource`` plus optional per-token labels) into rows the
model sees, and says how to batch them: ``plan`` (rows, real tokens per row, what was cut; ``plan_lengths`` the
same from document lengths alone), ``collator``, ``sampler``/``split_sampler``, ``keys``, ``shapes`` (``(rows,
length)`` of every batch, from lengths alone) and ``epoch_stats``. No Lightning import; ``SeqMemDataModule`` holds one
strategy per split (``eval_strategy`` may differ from training) and ``seqmem-plan`` asks the same objects, so the
planner's numbers are the DataModule's by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from lightning_seqmem.batch import CU_SEQLENS, PACK_KEYS, PAD_KEYS, full_rows, packed_rows, padded_rows
from lightning_seqmem.batching.collate import PackCollator, PadCollator, TruncateCollator
from lightning_seqmem.batching.packed_rows import PackResult, pack_lengths
from lightning_seqmem.batching.plan_cache import cached_pack_lengths
from lightning_seqmem.batching.sampling import BatchList, LengthGroupedSampler, ShuffledBatchSampler, TokenBudgetBatchSampler
from lightning_seqmem.data.tokens import as_token_source
from lightning_seqmem.batching.truncation import PromptCompletionLimits, count_truncated

STRATEGIES = ("pad", "truncate", "pack")


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
class Plan:
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
        return {"rows": self.rows, "batches": self.batches, "rows_dropped_per_epoch": self.rows_dropped_per_epoch,
                "token_efficiency": self.token_efficiency}


@dataclass
class BatchingOptions:
    """Options shared by every strategy (the DataModule's arguments)."""

    max_length: int
    pad_to_multiple_of: int | None = 8
    pad_to_max_length: bool = False
    truncation_side: str = "right"
    group_by_length: bool = False
    max_tokens_per_batch: int | None = None
    packing: str = "bfd"
    overflow: str = "split"
    return_cu_seqlens: bool = False
    plan_cache: str | None = None  # where packing plans of large datasets are kept (``plan_cache``)


class PadStrategy:
    """Each batch padded to its longest row (rounded up to ``pad_to_multiple_of``), rows cut at ``max_length``."""

    name = "pad"
    keys = PAD_KEYS

    def __init__(self, options: BatchingOptions) -> None:
        self.options = options
        self._shape_collator = None

    def prompt_completion_limits(self, limits: PromptCompletionLimits) -> PromptCompletionLimits:
        """The limits applied at dataset level to prompt/completion rows (all of them: rows fit ``max_length``)."""
        return limits

    def plan(self, source: Any, labels: Any = None) -> Plan:
        return Plan(DocumentRows(source, labels), *self.plan_lengths(source.lengths))

    def plan_lengths(self, lengths: np.ndarray) -> tuple[np.ndarray, dict[str, int]]:
        """``([rows] real tokens per row, counts of what was cut)`` from ``[documents]`` lengths alone."""
        m = self.options.max_length
        return np.minimum(lengths, m), {"tokens_truncated": count_truncated(lengths, m)}

    def collator(self, pad_token_id: int):
        o = self.options
        return PadCollator(pad_token_id, max_length=o.max_length, pad_to_multiple_of=o.pad_to_multiple_of,
                           pad_to_max_length=o.pad_to_max_length, truncation_side=o.truncation_side)

    def padded_length(self, longest: int) -> int:
        """The ``seq`` of a batch whose longest row has ``longest`` tokens (asked once per batch by samplers)."""
        if self._shape_collator is None:
            self._shape_collator = self.collator(0)
        return self._shape_collator.padded_length(longest)

    def rows_per_batch(self, batch_size: int) -> int:
        return batch_size

    def sampler(self, lengths: np.ndarray, batch_size: int, **common):
        o = self.options
        if o.max_tokens_per_batch is not None:
            return TokenBudgetBatchSampler(lengths, o.max_tokens_per_batch, padded_length=self.padded_length, **common)
        if o.group_by_length:
            return LengthGroupedSampler(lengths, batch_size, **common)
        return ShuffledBatchSampler(len(lengths), batch_size, **common)

    def split_sampler(self, lengths: np.ndarray, batch_size: int, train: bool, seed: int, drop_last: bool,
                      num_replicas: int | None = None, rank: int | None = None):
        """A split's sampler: train shuffles (``seed + epoch``) and honours ``drop_last``; validation keeps order
        and every row."""
        return self.sampler(lengths, batch_size, shuffle=train, seed=seed, num_replicas=num_replicas, rank=rank,
                            drop_last=drop_last and train)

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
        return EpochStats(rows=len(lengths), batches=len(shapes), rows_dropped_per_epoch=sampler.num_dropped,
                          token_efficiency=fed / max(sum(r * n for r, n in shapes), 1),
                          largest=self.largest(shapes) if shapes else None)

    @property
    def budget_shapes(self) -> bool:
        """Whether rows and length vary together (a token budget on padded batches): the largest batch is then the
        one with the most slots, not the largest rows and the largest length apart."""
        return self.options.max_tokens_per_batch is not None

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
    """Every row cut and padded to ``max_length``: one constant shape ``[rows, max_length]``."""

    name = "truncate"

    def collator(self, pad_token_id: int):
        o = self.options
        return TruncateCollator(pad_token_id, o.max_length, truncation_side=o.truncation_side)

    def rows_per_batch(self, batch_size: int) -> int:
        budget = self.options.max_tokens_per_batch
        return batch_size if budget is None else budget // self.options.max_length

    def sampler(self, lengths: np.ndarray, batch_size: int, **common):
        return ShuffledBatchSampler(len(lengths), self.rows_per_batch(batch_size), **common)

    budget_shapes = False  # a budget fixes the rows: every batch is [rows, max_length]

    def shapes(self, batches: BatchList, lengths: np.ndarray) -> list[tuple[int, int]]:
        return [(rows, self.options.max_length) for rows in _as_batch_list(batches).sizes.tolist()]

    def _never_padded(self, shortest: int, longest: int) -> bool:
        return shortest >= self.options.max_length


class PackStrategy(TruncateStrategy):
    """Documents packed into ``max_length`` rows once per split (epochs reshuffle rows, never re-pack)."""

    name = "pack"

    @property
    def keys(self) -> tuple[str, ...]:
        return PACK_KEYS + ((CU_SEQLENS,) if self.options.return_cu_seqlens else ())

    def prompt_completion_limits(self, limits: PromptCompletionLimits) -> PromptCompletionLimits:
        """``overflow="truncate"`` (the prompt/completion default): the full limits, so every row fits a row and
        keeps its prompt's end and its completion's start; otherwise only the per-part limits (overflow decides)."""
        if self.options.overflow == "truncate":
            return limits
        return PromptCompletionLimits(None, limits.max_prompt_length, limits.max_completion_length)

    def plan(self, source: Any, labels: Any = None) -> Plan:
        o = self.options
        # ``pack_sequences`` without a separator token, its plan planned once per node and mapped from disk
        source = as_token_source(source)
        packed = cached_pack_lengths(source.lengths, o.max_length, o.packing, o.overflow, o.plan_cache)
        packed.source = source
        return Plan(PackedRows(packed, labels), *self._rows_and_cuts(packed))

    def plan_lengths(self, lengths: np.ndarray) -> tuple[np.ndarray, dict[str, int]]:
        o = self.options
        return self._rows_and_cuts(pack_lengths(lengths, o.max_length, o.packing, o.overflow))

    @staticmethod
    def _rows_and_cuts(packed: PackResult) -> tuple[np.ndarray, dict[str, int]]:
        s = packed.stats()
        return np.diff(packed.row_offsets), {k: s[k] for k in ("tokens_truncated", "tokens_dropped", "documents_split")}

    def worst_layout(self, rows: int, length: int, lengths: np.ndarray | None = None) -> tuple[tuple[int, ...], ...]:
        """Two documents in every row (the block-diagonal mask transformers builds from restarting position_ids):
        row lengths alone do not tell whether a full row holds one document or several."""
        return packed_rows(rows, length)

    def collator(self, pad_token_id: int):
        return PackCollator(pad_token_id, self.options.max_length, return_cu_seqlens=self.options.return_cu_seqlens)


def _as_batch_list(batches) -> BatchList:
    """A sampler's batches as a ``BatchList`` (a user's sampler may give plain lists of indices)."""
    if isinstance(batches, BatchList):
        return batches
    sizes = [len(b) for b in batches]
    order = np.fromiter((i for b in batches for i in b), dtype=np.int64, count=sum(sizes))
    return BatchList.cut(order, sizes)


_BY_NAME = {cls.name: cls for cls in (PadStrategy, TruncateStrategy, PackStrategy)}


def make_strategy(name: str, options: BatchingOptions) -> PadStrategy:
    """The strategy object for ``name`` (``"pad"``, ``"truncate"`` or ``"pack"``)."""
    if name not in _BY_NAME:
        raise ValueError(f"Unknown strategy {name!r}; choose one of {list(STRATEGIES)}.")
    return _BY_NAME[name](options)


def largest_shape(strategies: list[PadStrategy], largest: list[tuple[int, int]]) -> tuple[int, int]:
    """The shape to pre-allocate for across splits, from each split's ``largest``: with a token budget on a ``pad``
    split rows and length vary together (the shape with the most slots), else the largest rows and length."""
    if any(s.budget_shapes for s in strategies):
        return max(largest, key=lambda s: (s[0] * s[1], s[1]))
    return max(s[0] for s in largest), max(s[1] for s in largest)
