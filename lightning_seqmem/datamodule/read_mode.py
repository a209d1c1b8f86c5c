"""How a DataModule reads its data: one object per read mode behind one protocol, so ``SeqMemDataModule`` asks the
same questions of a map-style dataset (``map_style.MapStyle``: the whole split planned, rows gathered on demand) and
of a stream (``stream_mode.StreamMode``: packed on the fly). No Lightning import."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from torch.utils.data import DataLoader

from lightning_seqmem.batching.strategies import Strategy
from lightning_seqmem.datamodule.pipeline import SPLITS
from lightning_seqmem.kinds.base import DOCUMENT_STATS, Kind


@runtime_checkable
class ReadMode(Protocol):
    """What ``SeqMemDataModule`` asks of the data once they are set up.

    Attributes:
        kind: the data kind (``lightning_seqmem.kinds``).
        strategies: the strategy object of each split's loader, chosen once (``split_strategies``).
        datasets: per split, the rows read (a ``Dataset``; a stream, or the documents held for validation).
        streaming: whether the sources are read as streams (``SeqMemDataModule.streaming``).
        restart: set by ``load_state_dict`` when the checkpoint's data differ and ``on_resume_mismatch`` is
            ``"restart_epoch"``: the loaders built afterwards start the epoch afresh.
    """

    kind: Kind
    strategies: dict[str, Strategy]
    datasets: dict[str, Any]
    tokenized: Sequence[tuple[Any, Any]]  # per map-style source: its name and token columns, compared across ranks
    streaming: bool
    restart: bool

    def loader(
        self, split: str, tokenizer: Any, pad_token_id: int, lookahead: Callable[[], int] | None = None
    ) -> DataLoader:
        """``split``'s loader, built to resume as the checkpoint's signature check decided (``restart``);
        ``lookahead``: the train batches Lightning has fetched ahead (a stream saves them with its position)."""

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per split, what ``SeqMemDataModule.stats()`` reports."""

    def max_batch_shape(self) -> tuple[int, int]:
        """The largest ``(rows, length)`` any loader yields."""

    def worst_batch_layout(self, rows: int, length: int) -> tuple[tuple[int, ...], ...]:
        """Document lengths per row of the costliest ``[rows, length]`` training batch."""

    def data_signature(self) -> dict[str, Any]:
        """What a saved loader position refers to (``signature.read_signature``, one builder for every mode)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the data."""

    def load_state_dict(self, state_dict: dict[str, Any], warn: Callable[[str], None]) -> None:
        """Check a checkpoint's data state before the loader position is restored."""


def split_strategies(kind: Kind, settings: Any, splits: Iterable[str] = SPLITS) -> dict[str, Strategy]:
    """The strategy objects of ``splits`` (a ``test`` split is batched as validation), built once the data kind
    is known (it decides the overflow rule; ``settings``: the DataModule's ``SeqMemSettings``)."""
    kind.check(settings.batching)
    return {split: kind.strategy(settings.batching, split, settings.data.plan_cache) for split in splits}


def check_same_layout(sources: list[tuple[str, Kind]]) -> None:
    """The sources of a ``Mix`` (``(name, kind)``, map-style or streamed) must batch alike: preference pairs mix
    only with preference pairs."""
    first, first_kind = sources[0]
    for name, kind in sources[1:]:
        if kind.sequences != first_kind.sequences:
            raise ValueError(
                f"Mix source {name!r} holds {kind.name} data and {first!r} {first_kind.name}: their batches have "
                "other layouts. Text, prompt/completion and conversations mix; preference pairs mix only with "
                "preference pairs."
            )


def per_source_stats(per: dict[str, dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A split's ``stats()`` of a ``Mix`` (map-style or streamed): the sums over its sources, ``extra``, and each
    source's own statistics under ``["sources"][name]``."""
    total = {k: sum(v.get(k, 0) for v in per.values()) for k in DOCUMENT_STATS if k != "longest_document"}
    return dict(total, **extra, sources=per)
