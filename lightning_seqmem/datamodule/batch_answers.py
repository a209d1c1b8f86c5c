"""What ``SeqMemDataModule`` answers about its batches, for the callbacks and apps that ask (``protocols.py``:
``GivesBatchKeys``, ``DescribesBatching``, ``GivesWorstBatchLayout``, ``GivesMaxBatchShape``, ``GivesDataStats``).

Every answer comes from the read mode once the data are set up; kept apart from the Lightning hooks so that the
DataModule's file is its wiring. No Lightning import.
"""

from __future__ import annotations

from typing import Any

from lightning_seqmem.datamodule.read_mode import ReadMode
from lightning_seqmem.protocols import NamesSources


class BatchAnswers:
    """The questions other components ask the DataModule about its batches, answered by its read mode and strategy
    objects (``_ready()`` sets the data up first when needed)."""

    settings: Any  # the DataModule's SeqMemSettings

    def _ready(self) -> ReadMode:  # defined by the DataModule
        raise NotImplementedError

    @property
    def max_length(self) -> int:
        """The longest row fed to the model (``settings.batching.max_length``)."""
        return self.settings.batching.max_length

    @property
    def eval_batch_size(self) -> int:
        """Rows per validation batch (``eval_batch_size``, else ``micro_batch_size``)."""
        return self.settings.batching.batch_size("validation")

    def batch_keys(self) -> tuple[str, ...]:
        """The keys of the batches the train loader yields (``eval_strategy`` may differ: see its loader)."""
        return tuple(self._ready().strategies["train"].keys)

    def batching_label(self) -> str:
        """The train loader's batching in a few words (``protocols.DescribesBatching``): ``"pack_bfd"``."""
        return self._ready().strategies["train"].label

    def constant_shapes(self) -> bool:
        """Whether every batch of the train and validation loaders has one shape (``protocols.DescribesBatching``)."""
        return all(strategy.constant_shapes for strategy in self._ready().strategies.values())

    def packs_documents(self) -> bool:
        """Whether some loader puts several documents in one row (``protocols.DescribesBatching``)."""
        return any(strategy.packs for strategy in self._ready().strategies.values())

    def worst_batch_layout(self, rows: int, length: int) -> tuple[tuple[int, ...], ...]:
        """Document lengths per row of the costliest ``[rows, length]`` training batch
        (``protocols.GivesWorstBatchLayout``, asked by ``CachePreallocator``): the train strategy's answer."""
        return self._ready().worst_batch_layout(rows, length)

    def max_batch_shape(self) -> tuple[int, int]:
        """The largest ``(rows, length)`` any loader (train or validation, whatever its strategy) yields, for
        pre-allocation. With a token budget, rows and length vary together: the shape with the most slots."""
        return self._ready().max_batch_shape()

    def stats(self) -> dict[str, Any]:
        """Per split: documents, tokens, tokens truncated/dropped, documents split, empty documents skipped,
        rows, batches, rows ``drop_last`` leaves out, and token efficiency (real tokens / slots in one epoch);
        for prompt/completion data also the rows skipped because no completion was left; for conversations also
        ``conversations_dropped_empty``, ``trained_tokens``, ``trained_share`` and ``mask_method``; for preference
        pairs (``documents`` = pairs) also the prompt / chosen / rejected tokens truncated, the pairs left without a
        completion and the pairs whose kept completions are identical. For a stream: what has been read so far on
        this process (``streams.counts.StreamCounts``). The keys each kind reports: ``kinds.base.DOCUMENT_STATS`` and
        its ``Kind.stats_keys``."""
        return self._ready().stats()

    def source_names(self) -> tuple[str, ...]:
        """The sources of a ``Mix`` (``protocols.NamesSources``), in the order of a validation batch's
        ``batch.SOURCE_INDEX``; ``()`` for a single dataset."""
        mode = self._ready()
        return mode.source_names() if isinstance(mode, NamesSources) else ()
