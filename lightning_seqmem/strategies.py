"""Batching strategies: pad, truncate, pack. Chosen once; each owns its rows, collator, sampler, keys and shapes.

A strategy turns a split's documents (a ``tokens.TokenSource`` plus optional per-token labels) into rows the
model sees, and says how to batch them: ``plan`` (rows, real tokens per row, what was cut), ``collator``,
``sampler``, ``keys`` and ``shapes`` (``(rows, length)`` of every batch, from lengths alone). No Lightning import;
``SeqMemDataModule`` holds one strategy per split (``eval_strategy`` may differ from training).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from lightning_seqmem.batch import CU_SEQLENS, PACK_KEYS, PAD_KEYS
from lightning_seqmem.collate import PackCollator, PadCollator, TruncateCollator
from lightning_seqmem.packed_rows import PackResult, pack_sequences
from lightning_seqmem.sampling import LengthGroupedSampler, ShuffledBatchSampler, TokenBudgetBatchSampler
from lightning_seqmem.truncation import PromptCompletionLimits, count_truncated

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
        m = self.options.max_length
        return Plan(DocumentRows(source, labels), np.minimum(source.lengths, m),
                    {"tokens_truncated": count_truncated(source.lengths, m)})

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

    def shapes(self, batches: list[list[int]], lengths: np.ndarray) -> list[tuple[int, int]]:
        """``(rows, length)`` of each batch."""
        return [(len(b), self.padded_length(int(lengths[b].max()))) for b in batches]

    def largest(self, shapes: list[tuple[int, int]]) -> tuple[int, int]:
        """The shape to pre-allocate for: with a token budget rows and length vary together (most slots)."""
        if self.options.max_tokens_per_batch is not None:
            return max(shapes, key=lambda s: (s[0] * s[1], s[1]))
        return max(s[0] for s in shapes), max(s[1] for s in shapes)


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

    def shapes(self, batches: list[list[int]], lengths: np.ndarray) -> list[tuple[int, int]]:
        return [(len(b), self.options.max_length) for b in batches]

    def largest(self, shapes: list[tuple[int, int]]) -> tuple[int, int]:
        return max(s[0] for s in shapes), self.options.max_length


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
        packed = pack_sequences(source, o.max_length, o.packing, o.overflow)
        s = packed.stats()
        return Plan(PackedRows(packed, labels), np.diff(packed.row_offsets),
                    {k: s[k] for k in ("tokens_truncated", "tokens_dropped", "documents_split")})

    def collator(self, pad_token_id: int):
        return PackCollator(pad_token_id, self.options.max_length, return_cu_seqlens=self.options.return_cu_seqlens)


_BY_NAME = {cls.name: cls for cls in (PadStrategy, TruncateStrategy, PackStrategy)}


def make_strategy(name: str, options: BatchingOptions) -> PadStrategy:
    """The strategy object for ``name`` (``"pad"``, ``"truncate"`` or ``"pack"``)."""
    if name not in _BY_NAME:
        raise ValueError(f"Unknown strategy {name!r}; choose one of {list(STRATEGIES)}.")
    return _BY_NAME[name](options)
