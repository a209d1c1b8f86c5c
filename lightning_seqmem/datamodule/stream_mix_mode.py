"""A ``Mix`` of streams (``streaming=True``): each source read as a stream is read alone (``streams.reading.Streams``:
its validation head, its packer, its counts), the training rows interleaved as they come (``streams.mixed``).
Validation keeps the sources apart, as map-style mixes do. No Lightning import.

Resume: the train loader is a ``StreamingLoader`` over the mixer, whose state holds its counts, the row each source
has read ahead and each source's reader state (``streams.rows.StreamingRows``): a resumed mix of streams goes on with
exactly the batches of the uninterrupted run. Another number of workers or ranks is refused by name (or restarts the
epoch with ``on_resume_mismatch="restart_epoch"``): the mixer's order is per reader.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_seqmem.batch import SOURCE_INDEX
from lightning_seqmem.data.sources import open_stream
from lightning_seqmem.datamodule.read_mode import check_same_layout, per_source_stats, split_strategies
from lightning_seqmem.datamodule.resume import SavesSignature
from lightning_seqmem.kinds.detect import detect_stream
from lightning_seqmem.mixing.spec import Mix
from lightning_seqmem.streams.identity import stream_identity
from lightning_seqmem.streams.loader import ResumePolicy, StreamingLoader
from lightning_seqmem.streams.mixed import MixedRows, row_documents, row_tokens
from lightning_seqmem.streams.reading import Streams, check_streaming, is_stream

SPLITS = ("train", "validation")


class StreamMixMode(SavesSignature):
    """A ``Mix`` whose sources are read as streams (``read_mode.ReadMode``).

    Args:
        mix: the sources, weights, ``by`` and ``exhausted``.
        settings: the DataModule's ``SeqMemSettings`` (each source may set its own ``text_column``).
        warn: where the loaders' warnings go, prefixed with the source's name.

    Raises:
        ValueError: a source whose batches cannot share the others' layout, or a batching that does not pack.
    """

    tokenized = ()  # streams: read as trained on, nothing tokenized ahead to compare across ranks

    streaming = True

    def __init__(self, mix: Mix, settings: Any, warn: Callable[[str], None], tokenizer: Callable[[], Any]) -> None:
        self.mix, self.settings, self.warn, self.tokenizer = mix, settings, warn, tokenizer
        self.sources: list[dict[str, Any]] = []
        for source in mix.sources:
            data = settings.data
            if source.text_column is not None:
                data = dataclasses.replace(data, text_column=source.text_column)
            mine = dataclasses.replace(settings, data=data)
            try:
                stream = source.dataset if is_stream(source.dataset) else open_stream(source.dataset)
                kind = detect_stream(stream, data.text_column)
                strategies = split_strategies(kind, mine, SPLITS)
                check_streaming(strategies)
                streams = Streams(stream, kind, data)  # reads the validation head
            except (ValueError, TypeError) as error:
                raise type(error)(f"Mix source {source.name!r}: {error}") from error
            self.sources.append(
                {"name": source.name, "kind": kind, "settings": mine, "strategies": strategies, "streams": streams}
            )
        check_same_layout([(s["name"], s["kind"]) for s in self.sources])
        first = self.sources[0]
        self.kind, self.strategies = first["kind"], first["strategies"]
        self.datasets = {split: [s["streams"].splits[split] for s in self.sources] for split in SPLITS}
        self.mixed: MixedRows | None = None

    def _loader(self, source: dict[str, Any], split: str, tokenizer: Any, pad_token_id: int) -> DataLoader:
        warn = partial(_from_source, self.warn, source["name"])
        strategy = source["strategies"][split]
        return source["streams"].loader(split, strategy, tokenizer, source["settings"], pad_token_id, warn)

    def loader(self, split: str, tokenizer: Any, pad_token_id: int, lookahead=None) -> DataLoader:
        if split not in SPLITS:
            raise ValueError(f"A Mix serves 'train' and 'validation', not {split!r}.")
        loaders = [self._loader(s, split, tokenizer, pad_token_id) for s in self.sources]
        if split == "validation":
            return DataLoader(TakingTurns(loaders), batch_size=None)
        units = row_tokens if self.mix.by == "tokens" else row_documents
        self.mixed = MixedRows([loader.dataset for loader in loaders], self.mix.weights, self.mix.exhausted, units)
        strategy = self.strategies["train"]
        return StreamingLoader(
            self.mixed,
            batch_size=strategy.rows_per_batch("train"),
            collate_fn=strategy.collator(pad_token_id),
            num_workers=self.settings.data.num_workers,
            policy=ResumePolicy(self.settings.data.on_resume_mismatch, self.warn, self.restart, lookahead),
        )

    @property
    def pretokenized(self) -> bool:
        """Every source holds token ids (checked as they are read, against a given tokenizer only)."""
        return all(s["kind"].pretokenized for s in self.sources)

    def source_names(self) -> tuple[str, ...]:
        """The names of the sources, in the order of ``batch[SOURCE_INDEX]`` (``protocols.NamesSources``)."""
        return self.mix.names

    def largest_token_id(self) -> None:
        return None  # streams: ids are checked as they are read

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per split the sums over the sources of what each has read so far on this process, and per source
        (``["sources"][name]``) its own counts (``streams.reading.Streams.stats``) and its weight."""
        out = {}
        for split in SPLITS:
            per = {
                s["name"]: dict(s["streams"].stats()[split], weight=self.mix.weight(s["name"])) for s in self.sources
            }
            out[split] = per_source_stats(per, streaming=True)
        return out

    def max_batch_shape(self) -> tuple[int, int]:
        """Packed rows: always ``max_length`` long, as many per batch as the split's batch size."""
        rows = max(strategy.rows_per_batch(split) for split, strategy in self.strategies.items())
        return rows, self.settings.batching.max_length

    def worst_batch_layout(self, rows: int, length: int) -> tuple[tuple[int, ...], ...]:
        return self.strategies["train"].worst_layout(rows, length, None)

    def identity(self) -> dict[str, Any]:
        """Each source's stream (its shards and files, the validation documents carved out of it), by name."""
        out = {}
        for source in self.sources:
            streams = source["streams"]
            for key, value in stream_identity(streams.read["train"], streams.leave_out).items():
                out[f"{key}/{source['name']}"] = value
        return out


def _from_source(warn: Callable[[str], None], name: str, message: str) -> None:
    """A source's warning, naming it (a module function: the read mode pickles, ``ddp_spawn``)."""
    warn(f"Mix source {name!r}: {message}")


class TakingTurns(IterableDataset):
    """Validation batches of every source's loader, the sources taking turns batch by batch, each batch tagged with
    its source (``SOURCE_INDEX``: ``LongTensor[rows]``). Under DDP every source's loader deals each rank the same
    number of batches, so every rank sees the sources in the same order."""

    def __init__(self, loaders: list[DataLoader]) -> None:
        self.loaders = loaders

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        readers = {s: iter(loader) for s, loader in enumerate(self.loaders)}
        while readers:
            for s in list(readers):
                batch = next(readers[s], None)
                if batch is None:
                    del readers[s]
                    continue
                batch[SOURCE_INDEX] = torch.full((batch["input_ids"].shape[0],), s, dtype=torch.long)
                yield batch
