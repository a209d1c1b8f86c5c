"""The mix read mode: each source of a ``Mix`` read map-style on its own, its training rows interleaved by weight.

Each source goes through the same split pipeline as a single dataset (its own kind, strategy, validation split and
statistics), so a source's rows are what it would give alone; only the order of training rows is the mix's
(``mixing.sampler.MixedBatchSampler``). Validation keeps the sources apart: its batches come one source at a time,
each tagged with its source (``batch.SOURCE_INDEX``) so the model logs ``val/loss/<name>`` beside ``val/loss``.
No Lightning import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_seqmem.batch import SOURCE_INDEX
from lightning_seqmem.batching.batch_list import BatchList
from lightning_seqmem.batching.sampling import BatchFetcher, _ShardedBatchSampler
from lightning_seqmem.batching.strategies import PackedRows, PadStrategy, largest_shape
from lightning_seqmem.data.columns import largest_of
from lightning_seqmem.datamodule.pipeline import load_documents, prepare_split, split_documents
from lightning_seqmem.datamodule.read_mode import check_same_layout, per_source_stats, split_strategies
from lightning_seqmem.datamodule.resume import ResumableLoader, SavesSignature
from lightning_seqmem.datamodule.signature import rows_identity
from lightning_seqmem.kinds.base import epoch_stats
from lightning_seqmem.mixing.sampler import MixedBatchSampler, mixed_sampler, row_tokens
from lightning_seqmem.mixing.spec import Mix


class MixMode(SavesSignature):
    """A ``Mix`` of map-style sources (``read_mode.ReadMode``).

    Args:
        mix: the sources, weights, ``by`` and ``exhausted``.
        settings: the DataModule's ``SeqMemSettings`` (each source may set its own ``text_column``).
        tokenizer: gives the tokenizer (one for every source).
        explicit_tokenizer: the user gave one (pre-tokenized ids are checked against it).
        warn, info: where the pipeline's warnings and notes go, prefixed with the source's name.

    Raises:
        ValueError: sources whose batches cannot share a layout (preference pairs with anything else), a source
            with no training row (empty, or every document dropped), each named.
    """

    def __init__(
        self,
        mix: Mix,
        settings: Any,
        tokenizer: Callable[[], Any],
        explicit_tokenizer: bool,
        warn: Callable[[str], None],
        info: Callable[[str], None],
    ) -> None:
        self.mix, self.settings, self.tokenizer = mix, settings, tokenizer
        self.seed = settings.batching.seed if mix.seed is None else mix.seed
        self.sources: list[dict[str, Any]] = []  # per source: kind, strategies, rows, lengths, units, stats
        self.tokenized: list[tuple[str, Any]] = []  # per source: its name and token columns (compared across ranks)
        for source in mix.sources:
            data = settings.data
            if source.text_column is not None:
                data = dataclasses.replace(data, text_column=source.text_column)
            try:
                tokenized, kind, largest = load_documents(
                    source.dataset, data, tokenizer, explicit_tokenizer, settings.conversation
                )
            except (ValueError, TypeError) as error:  # the same error, naming the source
                raise type(error)(f"Mix source {source.name!r}: {error}") from error
            self.tokenized.append((f"Mix source {source.name!r}", tokenized))
            self.sources.append(self._prepare(source.name, tokenized, kind, tokenizer, warn, info))
            self.sources[-1]["largest"] = largest
        check_same_layout([(s["name"], s["kind"]) for s in self.sources])
        self.kind = self.sources[0]["kind"]
        self.strategies = self.sources[0]["strategies"]  # every source batches alike (``_check_layouts``)
        self.datasets = {split: [s["datasets"][split] for s in self.sources] for split in ("train", "validation")}
        self._epoch_stats: tuple[MixedBatchSampler, Any] | None = None

    def _prepare(self, name, tokenized, kind, tokenizer, warn, info) -> dict[str, Any]:
        docs = split_documents(tokenized, kind, self.settings.batching.seed)
        strategies = split_strategies(kind, self.settings, docs)
        out = {
            "name": name,
            "kind": kind,
            "strategies": strategies,
            "datasets": {},
            "rows": {},
            "lengths": {},
            "stats": {},
        }
        for split, split_docs in docs.items():
            try:
                prepared = prepare_split(split, split_docs, strategies[split], self.settings)
            except ValueError as error:
                raise ValueError(f"Mix source {name!r}: {error}") from error
            prepared.stats.update(kind.tokenizer_stats(tokenizer))
            for message in prepared.warnings:
                warn(f"Mix source {name!r}: {message}")
            for message in prepared.infos:
                info(f"{message} (Mix source {name!r})")
            out["datasets"][split], out["rows"][split] = prepared.dataset, prepared.rows
            out["lengths"][split], out["stats"][split] = prepared.lengths, prepared.stats
        if len(out["lengths"]["train"]) == 0 and self.mix.weight(name) > 0:
            raise ValueError(
                f"Mix source {name!r} gives no training row: every document was dropped "
                f"({out['stats']['train'].get('tokens_dropped', 0)} tokens dropped). Check its column settings, "
                "raise max_length, or give it weight 0."
            )
        out["units"] = self._units(out["rows"]["train"], out["lengths"]["train"])
        return out

    def _units(self, rows: Any, lengths: np.ndarray) -> np.ndarray:
        """What a weight counts in each training row: its real tokens, or (``by="documents"``) its documents (the
        pieces a packed row holds)."""
        if self.mix.by == "tokens":
            return row_tokens(lengths)
        if isinstance(rows, PackedRows):
            return np.diff(rows.packed.seg_row_offsets).astype(np.int64)
        return np.ones(len(lengths), dtype=np.int64)

    # ------------------------------------------------------------------------------------------- loaders
    def sampler(self, num_replicas: int | None = None, rank: int | None = None) -> MixedBatchSampler:
        """The training sampler over the sources' rows laid end to end (``_rows("train")``)."""
        return mixed_sampler(
            self.mix.weights,
            [s["units"] for s in self.sources],
            [s["lengths"]["train"] for s in self.sources],
            self.mix.exhausted,
            self.strategies["train"],
            seed=self.seed,
            num_replicas=num_replicas,
            rank=rank,
        )

    def loader(self, split: str, tokenizer: Any, pad_token_id: int, lookahead=None) -> DataLoader:
        if split not in ("train", "validation"):
            raise ValueError(f"A Mix serves 'train' and 'validation', not {split!r}.")
        collate = self.strategies[split].collator(pad_token_id)
        if split == "train":
            sampler = self.sampler()
        else:
            sampler = SourceBatches(
                [s["strategies"][split].split_sampler(s["lengths"][split], split) for s in self.sources]
            )
            collate = SourceTagged(collate)
        loader = ResumableLoader(
            BatchFetcher(SourceRows([s["rows"][split] for s in self.sources], tag=split != "train")),
            sampler=sampler,
            batch_size=None,
            collate_fn=collate,
            num_workers=self.settings.data.num_workers,
            persistent_workers=self.settings.data.num_workers > 0,
            restart=self.restart,
        )
        return loader

    @property
    def pretokenized(self) -> bool:
        """Every source holds token ids (then a given ``pad_token_id`` needs no tokenizer)."""
        return all(s["kind"].pretokenized for s in self.sources)

    def largest_token_id(self) -> Any:
        """The largest id of the pre-tokenized sources (``GivesLargestTokenId``), ``None`` where none is."""
        return largest_of([s["largest"] for s in self.sources])

    def source_names(self) -> tuple[str, ...]:
        """The names of the sources, in the order of ``batch[SOURCE_INDEX]`` (``protocols.NamesSources``)."""
        return self.mix.names

    # ------------------------------------------------------------------------------------------- answers
    def stats(self) -> dict[str, dict[str, Any]]:
        """Per split the sums over the sources, and per source (``["sources"][name]``) its own statistics; the
        training split adds what this process reads of each in epoch 0 (``rows_read``, ``tokens_read``, ``share``
        of the tokens read, ``weight``, ``passes``, ``repeats``, ``rows_unread``, ``token_efficiency_in_mix``)."""
        out = {}
        for split in ("train", "validation"):
            out[split] = per_source_stats({s["name"]: dict(s["stats"][split]) for s in self.sources})
        sampler, mixed = self._epoch0()
        counts = sampler.source_counts(0)
        read = sum(c["tokens"] for c in counts) or 1
        for s, c, efficiency in zip(self.sources, counts, self._efficiency_in_mix(sampler)):
            out["train"]["sources"][s["name"]].update(
                token_efficiency_in_mix=efficiency,
                rows_read=c["rows"],
                tokens_read=c["tokens"],
                share=c["tokens"] / read,
                weight=self.mix.weight(s["name"]),
                passes=c["passes"],
                repeats=c["repeats"],
                rows_unread=c["rows_unread"],
            )
        out["train"].update(mixed.counts(), rows=int(sum(c["rows"] for c in counts)))  # the mixed epoch's batches
        return out

    def _efficiency_in_mix(self, sampler: MixedBatchSampler) -> list[float | None]:
        """Per source, its real tokens / the slots its rows take in the mixed batches of epoch 0 (a padded row takes
        its batch's length); ``None`` for pair strategies (their rows are sequences two by two)."""
        strategy = self.strategies["train"]
        if not isinstance(strategy, PadStrategy):  # Pad, Truncate and Pack
            return [None] * len(self.sources)
        batches = sampler.batches(0)
        lengths = np.concatenate([s["lengths"]["train"] for s in self.sources])
        widths = np.repeat([w for _, w in strategy.shapes(batches, lengths)], batches.sizes)
        rows = np.concatenate([batches.order[a:b] for a, b in zip(batches.starts, batches.ends)] or [np.zeros(0, int)])
        source = sampler.source_of(rows)
        tokens = np.bincount(source, weights=lengths[rows], minlength=len(self.sources))
        slots = np.bincount(source, weights=widths, minlength=len(self.sources))
        return [float(t / n) if n else None for t, n in zip(tokens, slots)]

    def _epoch0(self) -> tuple[MixedBatchSampler, Any]:
        """A sampler of this process's mixed epoch 0 and its ``EpochStats`` (batches, rows ``drop_last`` or
        ``stop`` leave out, efficiency, largest batch), planned once for ``stats()`` and the batch shapes."""
        if self._epoch_stats is None:
            sampler = self.sampler()
            lengths = np.concatenate([s["lengths"]["train"] for s in self.sources])
            self._epoch_stats = (sampler, self.strategies["train"].epoch_stats(lengths, sampler))
        return self._epoch_stats

    def max_batch_shape(self) -> tuple[int, int]:
        """The largest of the mixed training batches (epoch 0) and of each source's validation batches."""
        largest = [self._epoch0()[1].largest] + [
            epoch_stats(s["strategies"]["validation"], s["lengths"]["validation"], "validation").largest
            for s in self.sources
            if len(s["lengths"]["validation"])
        ]
        return largest_shape(list(self.strategies.values()), [x for x in largest if x is not None])

    def worst_batch_layout(self, rows: int, length: int) -> tuple[tuple[int, ...], ...]:
        lengths = np.concatenate([s["lengths"]["train"] for s in self.sources])
        return self.strategies["train"].worst_layout(rows, length, lengths)

    # ------------------------------------------------------------------------------------------- resume
    def identity(self) -> dict[str, Any]:
        """Every source's train rows laid end to end, in source order: their count and a checksum of their lengths."""
        return rows_identity(np.concatenate([s["lengths"]["train"] for s in self.sources]))

    def mix_seed(self) -> int:
        return self.seed


class SourceRows(Dataset):
    """The sources' rows laid end to end; with ``tag`` each comes as ``(row, source index)``.

    A pair, not a ``"source"`` key added to the row: a row is whatever the strategy's collator takes, a dict for
    text or a list of pairs for packed preference pairs (``PackedPairRows``).
    """

    def __init__(self, rows: list[Any], tag: bool = False) -> None:
        self.rows, self.tag = rows, tag
        self.offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> Any:
        s = int(np.searchsorted(self.offsets, i, side="right") - 1)
        example = self.rows[s][int(i - self.offsets[s])]
        return (example, s) if self.tag else example


class SourceTagged:
    """A collator whose batch (all of one source) also carries ``SOURCE_INDEX``: ``LongTensor[rows]``. Takes the
    ``(row, source index)`` pairs of ``SourceRows(tag=True)``."""

    def __init__(self, collate: Callable) -> None:
        self.collate = collate

    def __call__(self, tagged: list[tuple[Any, int]]) -> dict[str, torch.Tensor]:
        batch = self.collate([row for row, _ in tagged])
        batch[SOURCE_INDEX] = torch.tensor([source for _, source in tagged], dtype=torch.long)
        return batch


class SourceBatches(_ShardedBatchSampler):
    """Validation batches of every source (each source's own sampler, its batches in order), the sources taking
    turns one round of ranks at a time, so each step gives every rank a batch of the same source and a limit on
    validation batches (``limit_val_batches``) still sees every source; indices shifted to the sources' rows laid
    end to end. No batch mixes sources."""

    def __init__(self, samplers: list[Any]) -> None:
        self.samplers = samplers
        self.offsets = np.concatenate([[0], np.cumsum([s.num_items for s in samplers])]).astype(np.int64)
        first = samplers[0]
        super().__init__(int(self.offsets[-1]), False, first.seed, first.num_replicas, first.rank)

    def global_batches(self, epoch: int) -> BatchList:
        parts = [s.global_batches(epoch) for s in self.samplers]
        order = np.concatenate([p.order + k for p, k in zip(parts, self.offsets[:-1])])
        shift = np.cumsum([0] + [len(p.order) for p in parts[:-1]])
        starts = [p.starts + k for p, k in zip(parts, shift)]
        ends = [p.ends + k for p, k in zip(parts, shift)]
        w = self.num_replicas  # every source's batch count is a multiple of it: rounds of one batch per rank
        rounds = max(len(p) for p in parts) // w
        turns = [(r, s) for r in range(rounds) for s in range(len(parts)) if r * w < len(parts[s])]

        def pick(spans: list[np.ndarray]) -> np.ndarray:
            return np.concatenate([spans[s][r * w : (r + 1) * w] for r, s in turns] or [np.zeros(0, np.int64)])

        return BatchList(order, pick(starts), pick(ends))
