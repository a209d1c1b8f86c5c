"""The questions components ask each other, named as ``typing.Protocol``\\ s.

A callback that needs the run's largest batch asks ``isinstance(trainer.datamodule, GivesMaxBatchShape)`` instead of
``getattr(dm, "max_batch_shape", None)``, so the import graph shows who depends on whom, and any DataModule or
callback that has the method (``SeqMemDataModule``, ``SeqLengthWarmup``, your own) answers without subclassing.
Different questions have different names: the DataModule's largest shape takes no argument; the warmup callback's
answer is a function of the DataModule's shape. No torch or Lightning import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "CountsTrainingTokens",
    "DescribesBatching",
    "GivesBatchKeys",
    "GivesDataStats",
    "GivesLargestTokenId",
    "GivesMaxBatchShape",
    "GivesWarmupShape",
    "GivesWorstBatchLayout",
    "NamesSources",
    "find_pad_token_id",
]


@runtime_checkable
class GivesMaxBatchShape(Protocol):
    """A DataModule that knows the largest ``(rows, length)`` batch any of its loaders yields."""

    def max_batch_shape(self) -> tuple[int, int]: ...


@runtime_checkable
class GivesBatchKeys(Protocol):
    """A DataModule that knows the keys of the batches its train loader yields (see ``lightning_seqmem.batch``)."""

    def batch_keys(self) -> tuple[str, ...]: ...


@runtime_checkable
class GivesWorstBatchLayout(Protocol):
    """A DataModule that knows what its costliest ``[rows, length]`` training batch holds: per row, the lengths of
    its documents (the rest of the row is padding). Padding or several documents in a row make transformers build
    an attention mask that one unpadded document does not; ``CachePreallocator`` builds its batch from this."""

    def worst_batch_layout(self, rows: int, length: int) -> tuple[tuple[int, ...], ...]: ...


@runtime_checkable
class GivesWarmupShape(Protocol):
    """A callback that reshapes training batches and knows the largest shape it makes of ``[rows, length]`` ones."""

    def max_warmup_shape(self, rows: int, length: int) -> tuple[int, int]: ...


@runtime_checkable
class GivesDataStats(Protocol):
    """A DataModule that reports what its data path did (documents, tokens truncated or dropped, efficiency)."""

    def stats(self) -> dict[str, Any]: ...


@runtime_checkable
class NamesSources(Protocol):
    """A DataModule reading a ``Mix``: the names of its sources, in the order of a validation batch's
    ``batch.SOURCE_INDEX`` (``CausalLM`` logs ``val/loss/<name>`` for each)."""

    def source_names(self) -> tuple[str, ...]: ...


@runtime_checkable
class GivesLargestTokenId(Protocol):
    """A DataModule that knows the largest token id of its data, where no tokenizer bounds them (pre-tokenized
    data): a ``LargestTokenId`` (``id``, ``split``, ``column``), or ``None`` where it does not know. ``CausalLM``
    refuses, before the first step, a model with no embedding row for it."""

    def largest_token_id(self) -> Any: ...


@runtime_checkable
class DescribesBatching(Protocol):
    """A DataModule that says how its batches are made, for checks and reports (``ConfigChecks``, ``RunSummary``).

    ``batching_label``: the train loader's batching in a few words (``"pad"``, ``"pack_bfd"``);
    ``constant_shapes``: every batch of every loader (train and validation) has one shape, so the CUDA caching
    allocator reuses its blocks; ``packs_documents``: some loader puts several documents in one row (attention must
    then keep them apart).
    """

    def batching_label(self) -> str: ...

    def constant_shapes(self) -> bool: ...

    def packs_documents(self) -> bool: ...


@runtime_checkable
class CountsTrainingTokens(Protocol):
    """A LightningModule that counts what its training steps fed the model (``CausalLM``; ``RunSummary`` reads it):
    real tokens, slots (rows x padded length) and the seconds spent inside training steps."""

    @property
    def real_tokens_seen(self) -> int: ...

    @property
    def slots_seen(self) -> int: ...

    @property
    def train_seconds(self) -> float: ...


@runtime_checkable
class SurvivesOom(Protocol):
    """A LightningModule that survives out-of-memory micro-batches by running them in parts (``CausalLM(on_oom=
    "split")``; ``MemoryMonitor`` and ``RunSummary`` read it): the failed attempts it split, the size it now splits
    at (tokens, ``None`` before any failure) and one event per failure (``stage``, ``step``, ``tokens``,
    ``allocated``, ``reserved``)."""

    @property
    def oom_splits(self) -> int: ...

    @property
    def oom_split_tokens(self) -> int | None: ...

    @property
    def oom_events(self) -> list[dict[str, Any]]: ...


def find_pad_token_id(*owners: object) -> int | None:
    """The first int ``pad_token_id`` among ``owners``: an attribute, or a key of a mapping such as ``hparams``.

    Example::

        find_pad_token_id(trainer.datamodule, pl_module, pl_module.hparams)
    """
    for owner in owners:
        pad = owner.get("pad_token_id") if isinstance(owner, Mapping) else getattr(owner, "pad_token_id", None)
        if isinstance(pad, int) and not isinstance(pad, bool):
            return pad
    return None
