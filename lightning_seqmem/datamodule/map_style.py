"""The map-style read mode: every split through the pure split pipeline (``pipeline.py``) once, its rows planned
on lengths and gathered when served, its loader resumable at the exact batch (``resume.py``). No Lightning
import."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

from lightning_seqmem.batching.sampling import BatchFetcher
from lightning_seqmem.batching.strategies import largest_shape
from lightning_seqmem.datamodule.pipeline import prepare_split, split_documents
from lightning_seqmem.datamodule.read_mode import split_strategies
from lightning_seqmem.datamodule.resume import ResumableLoader, SavesSignature
from lightning_seqmem.datamodule.signature import rows_identity
from lightning_seqmem.kinds.base import Kind, epoch_stats


class MapStyle(SavesSignature):
    """A tokenized (or pre-tokenized) ``DatasetDict`` read as whole splits (``read_mode.ReadMode``).

    Args:
        tokenized: the token columns (``SeqMemDataModule.tokenized_documents``).
        kind: their data kind.
        settings: the DataModule's ``SeqMemSettings``.
        tokenizer: gives the tokenizer when a kind's statistics need it.
        warn, info: where the pipeline's warnings and notes go (``rank_zero_warn``/``rank_zero_info``).
    """

    def __init__(
        self,
        tokenized: Any,
        kind: Kind,
        settings: Any,
        tokenizer: Callable[[], Any],
        warn: Callable[[str], None],
        info: Callable[[str], None],
        source: Any = None,
    ) -> None:
        self.kind, self.settings, self.tokenizer = kind, settings, tokenizer
        self.tokenized = [(source, tokenized)]  # what every rank compares (``ReadMode.tokenized``)
        documents = split_documents(tokenized, kind, settings.batching.seed, test=True)
        self.strategies = split_strategies(kind, settings, documents)
        self.datasets: dict[str, Any] = {}
        self.rows: dict[str, Any] = {}
        self.labels: dict[str, Any] = {}  # per split: the token source of labels, where rows carry their own
        self.lengths: dict[str, np.ndarray] = {}  # per row fed to the model, after truncation
        self._stats: dict[str, dict[str, Any]] = {}
        for split, docs in documents.items():
            prepared = prepare_split(split, docs, self.strategies[split], settings)
            prepared.stats.update(kind.tokenizer_stats(tokenizer))
            for message in prepared.warnings:
                warn(message)
            for message in prepared.infos:
                info(message)
            self.datasets[split], self.rows[split] = prepared.dataset, prepared.rows
            self.lengths[split], self.labels[split] = prepared.lengths, prepared.labels
            self._stats[split] = prepared.stats
        oversized = settings.batching.oversized_batch(len(self.lengths["train"])) if "train" in self.lengths else None
        if oversized:
            warn(oversized)

    def loader(self, split: str, tokenizer: Any, pad_token_id: int, lookahead=None) -> DataLoader:
        strategy, data = self.strategies[split], self.settings.data
        return ResumableLoader(
            BatchFetcher(self.rows[split]),
            sampler=strategy.split_sampler(self.lengths[split], split),
            batch_size=None,
            collate_fn=strategy.collator(pad_token_id),
            num_workers=data.num_workers,
            persistent_workers=data.num_workers > 0,
            restart=self.restart,
        )

    def stats(self) -> dict[str, dict[str, Any]]:
        return {split: dict(v) for split, v in self._stats.items()}

    def max_batch_shape(self) -> tuple[int, int]:
        """With a token budget, rows and length vary together: the shape with the most slots."""
        largest = [
            epoch_stats(self.strategies[split], self.lengths[split], split).largest
            for split in self.rows
            if len(self.rows[split])
        ]
        return largest_shape(list(self.strategies.values()), [s for s in largest if s is not None])

    def worst_batch_layout(self, rows: int, length: int) -> tuple[tuple[int, ...], ...]:
        return self.strategies["train"].worst_layout(rows, length, self.lengths.get("train"))

    def identity(self) -> dict[str, Any]:
        """The train rows: their count and a checksum of their lengths."""
        return rows_identity(self.lengths.get("train"))
