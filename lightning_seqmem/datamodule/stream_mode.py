"""The streamed read mode: a ``datasets`` stream packed on the fly (``streams/``), what it has read counted
as it is read. Only strategies that pack can serve it. No Lightning import."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader

from lightning_seqmem.datamodule.pipeline import SPLITS, TEST
from lightning_seqmem.datamodule.read_mode import split_strategies
from lightning_seqmem.datamodule.resume import SavesSignature
from lightning_seqmem.kinds.base import Kind
from lightning_seqmem.streams.identity import stream_identity
from lightning_seqmem.streams.loader import ResumePolicy
from lightning_seqmem.streams.reading import Streams, check_streaming


class StreamMode(SavesSignature):
    """A stream read as it is trained on (``read_mode.ReadMode``).

    Args:
        dataset: the stream (``IterableDataset``/``IterableDatasetDict``).
        kind: its data kind (``kinds.detect_stream``).
        settings: the DataModule's ``SeqMemSettings``.
        warn: where the loaders' warnings go (``rank_zero_warn``).
        tokenizer: gives the tokenizer (``None`` for token ids given without one), for the resume signature.
    """

    tokenized = ()  # streams: read as trained on, nothing tokenized ahead to compare across ranks

    def __init__(
        self,
        dataset: Any,
        kind: Kind,
        settings: Any,
        warn: Callable[[str], None],
        tokenizer: Callable[[], Any] = type(None),
    ) -> None:
        self.kind, self.settings, self.warn = kind, settings, warn
        # a test split (when the stream has one) is batched as validation: checked with it before anything is read
        self.strategies = split_strategies(kind, settings, (*SPLITS, TEST))
        check_streaming(self.strategies)
        self.streams = Streams(dataset, kind, settings.data)
        self.datasets = self.streams.splits
        self.tokenizer = tokenizer

    streaming = True

    def loader(self, split: str, tokenizer: Any, pad_token_id: int, lookahead=None) -> DataLoader:
        policy = ResumePolicy(self.settings.data.on_resume_mismatch, self.warn, self.restart, lookahead)
        strategy = self.strategies[split]
        return self.streams.loader(split, strategy, tokenizer, self.settings, pad_token_id, self.warn, policy)

    def stats(self) -> dict[str, dict[str, Any]]:
        """What has been read so far on this process (a stream's totals are known only once it is read)."""
        return self.streams.stats()

    def max_batch_shape(self) -> tuple[int, int]:
        """Packed rows: always ``max_length`` long, as many per batch as the split's batch size."""
        rows = max(strategy.rows_per_batch(split) for split, strategy in self.strategies.items())
        return rows, self.settings.batching.max_length

    def worst_batch_layout(self, rows: int, length: int) -> tuple[tuple[int, ...], ...]:
        return self.strategies["train"].worst_layout(rows, length, None)

    def identity(self) -> dict[str, Any]:
        """The stream: its shards and files, the validation documents carved out of it."""
        return stream_identity(self.streams.read["train"], self.streams.leave_out)
