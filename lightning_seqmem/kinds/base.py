"""What every data kind answers, and what the split pipeline shares between kinds.

A data kind (text, prompt/completion, conversations, preference pairs; each but conversations also pre-tokenized) is
one object (:class:`Kind`) that answers every question about itself: the columns it is read from, the map function
that encodes a batch of its rows into token columns (the one the token cache, ``datasets.map`` and streams run),
its token columns as views, how a split of it becomes rows (which tokens carry loss, what truncation cuts), how one
streamed row is cut, how many sequences an item is, and which statistics it reports. No Lightning import.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from lightning_seqmem.batching.strategies import EpochStats, Strategy
from lightning_seqmem.data.sources import select_rows
from lightning_seqmem.data.tokens import view_of_dataset

DOCUMENT_STATS = (
    "documents",
    "empty_documents_skipped",
    "tokens",
    "tokens_truncated",
    "tokens_dropped",
    "documents_split",
    "documents_over_max_length",
    "longest_document",
)
"""The statistics every kind reports, map-style and streamed (``stats()[split]``); each kind adds its own
(:attr:`Kind.stats_keys`)."""


@dataclass(frozen=True)
class Documents:
    """A split's non-empty documents as token views, per part (``documents``; or ``prompt`` and ``completion``)."""

    dataset: Any  # the split's rows, empty documents left out (an index selection: no tokens copied)
    kind: Kind
    parts: dict[str, Any]  # part name -> token source (``tokens.TokenSource``)
    labels: Any  # pre-tokenized text with a ``labels`` column: its token source; else None
    empty: int  # empty documents left out

    @property
    def lengths(self) -> np.ndarray:
        """``[documents]`` token counts (prompt + completion for prompt/completion rows)."""
        return sum(source.lengths for source in self.parts.values())


@dataclass
class PreparedSplit:
    """A split after the pipeline: what its loader serves and what ``stats()`` reports."""

    dataset: Any
    rows: Any  # the rows served (a ``Dataset`` gathering tokens on demand)
    lengths: np.ndarray  # [rows] real tokens per row fed to the model
    labels: Any  # the token source of labels, where rows carry their own
    stats: dict[str, Any]
    warnings: list[str] = field(default_factory=list)  # for ``rank_zero_warn``
    infos: list[str] = field(default_factory=list)  # for ``rank_zero_info``


@dataclass
class SplitRows:
    """What a kind makes of a split's documents before the strategy plans them: the token source and labels of
    its rows, the dataset they index, what was cut on the way (added to ``stats``), and the warnings to give."""

    source: Any
    labels: Any
    dataset: Any
    stats: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def epoch_stats(strategy: Strategy, lengths: np.ndarray, split: str) -> EpochStats:
    """Epoch 0 of ``split`` on one process, rows of ``[rows]`` real tokens (``strategies.EpochStats``)."""
    return strategy.epoch_stats(lengths, strategy.split_sampler(lengths, split, num_replicas=1, rank=0))


def lost_tokens(split: str, stats: dict, strategy: Strategy, max_length: int, fix: str) -> list[str]:
    """The warning for tokens that never reach the model, with the kind's or the strategy's fix."""
    truncated, dropped = stats["tokens_truncated"], stats["tokens_dropped"]
    if not truncated + dropped:
        return []
    return [
        f"{split}: {stats['documents_over_max_length']} documents are longer than max_length={max_length}; "
        f"with batching={strategy.options!r}, {truncated + dropped:,} of {stats['tokens']:,} tokens "
        f"({100 * (truncated + dropped) / max(stats['tokens'], 1):.2f}%) never reach the model "
        f"({truncated:,} truncated, {dropped:,} dropped). {fix}"
    ]


def count_document(counts: Counter, length: int) -> None:
    """A streamed document of ``length`` tokens read (before truncation)."""
    counts["documents"] += 1
    counts["tokens"] += length
    counts["longest_document"] = max(counts["longest_document"], length)


class Kind:
    """One kind of data. Subclasses set the class attributes and the methods marked so; instances are immutable
    and picklable (token-cache workers and loader workers get them).

    Attributes:
        name: the kind of rows it gives (``"text"``, ``"prompt_completion"``, ``"conversations"``,
            ``"preference"``), the same for its pre-tokenized form.
        parts: part name -> token column of its rows.
        sequences: sequences per item (1; 2 for a preference pair).
        streams: whether a stream of it can be served on the fly.
        stats_keys: the statistics it reports beside :data:`DOCUMENT_STATS`, map-style and streamed.
        trains_whole: packing never splits an item (it is cut by its own rule first, or is a pair): the planner
            leaves out ``Pack(method="wrapped")``.
        default_overflow: what packing does with a row over ``max_length`` unless ``Pack(overflow=...)`` says:
            ``"split"`` (text), ``"truncate"`` (prompt/completion: a piece without its prompt would train on an
            answer to nothing; conversations: already cut by whole turns).
        planned: ``seqmem-plan`` plans a dataset of it alone, on :meth:`plan_lengths` (prompt/completion rows: so
            far only as a source of a ``Mix``, whose planner cuts them per strategy).
        pretokenized: its rows carry token ids, used as they are (their values checked).
    """

    name: ClassVar[str]
    parts: ClassVar[dict[str, str]]
    sequences: ClassVar[int] = 1
    streams: ClassVar[bool] = True
    stats_keys: ClassVar[tuple[str, ...]] = ()
    trains_whole: ClassVar[bool] = False  # cut by its own rule before packing (conversations): never split
    default_overflow: ClassVar[str] = "split"  # what packing does with a row over max_length, unless told
    planned: ClassVar[bool] = True  # seqmem-plan plans it (``plan_lengths``)

    def __init__(self, pretokenized: bool = False) -> None:
        self.pretokenized = pretokenized

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pretokenized={self.pretokenized})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), self.pretokenized))

    # ------------------------------------------------------------------------------------------------ columns
    @property
    def id_columns(self) -> tuple[str, ...]:
        """The token-id columns of its rows (whose values a pre-tokenized dataset has checked)."""
        return tuple(self.parts.values())

    @property
    def column_kind(self) -> str:
        """Its name as a dataset's columns say it (``"tokens"`` for pre-tokenized text, ``"<name>_tokens"``)."""
        return f"{self.name}_tokens" if self.pretokenized else self.name

    def source_columns(self, text_column: str = "text") -> list[str]:  # subclass
        """The columns a row is read from."""
        raise NotImplementedError

    def cache_key(self, tokenizer: Any, conversation: Any = None) -> list[str]:
        """What besides the tokenizer and the columns decides its tokens (the token cache's key)."""
        return []

    def carry_columns(self, raw: Any, tokenized: Any) -> Any:
        """``tokenized`` (the token cache's columns) with what else the rows bring along (``raw``: the data)."""
        return tokenized

    # ---------------------------------------------------------------------------------------------- batching
    def check(self, batching: Any) -> None:
        """Refuse batching settings (``BatchingSettings``) that do not suit this kind, known only once the data
        are read. Text and preference pairs take any (pairs are always packed whole, best fit)."""

    def strategy(self, batching: Any, split: str, plan_cache: str | None = None) -> Strategy:
        """The strategy object of ``split``'s loader for this kind (its :attr:`default_overflow` for ``Pack``)."""
        from lightning_seqmem.batching.strategies import make_strategy

        return make_strategy(batching, split, self.default_overflow, plan_cache)

    def signature(self, settings: Any) -> dict[str, Any]:
        """The settings that decide the train rows (a resumed loader position refers to them)."""
        return settings.batching.signature(self.default_overflow)

    # -------------------------------------------------------------------------------------------- planning
    def plan_lengths(self, docs: Documents, settings: Any) -> Any:
        """What ``seqmem-plan`` plans a split on (:attr:`planned` kinds, and any source of a ``Mix``): ``[documents]``
        token counts; conversations, prompt/completion rows and pairs say otherwise."""
        return docs.lengths

    def sequence_lengths(self, lengths: Any) -> np.ndarray:
        """``[sequences]`` whole token counts of what :meth:`plan_lengths` gave, before any cut (the distribution
        the planner draws against ``max_length``)."""
        return np.asarray(lengths)

    def leaves_room(self, batching: Any, max_length: int) -> bool:
        """Whether rows of ``max_length`` leave room for what this kind trains on (the planner's candidates)."""
        return True

    # ----------------------------------------------------------------------------------------------- encoding
    def encoder(self, tokenizer: Any, text_column: str = "text", conversation: Any = None, vocab_size=None):
        """The batched map function of its rows: ``fn(batch, indices, split) -> token columns + length``."""
        if self.pretokenized:
            from lightning_seqmem.data.columns import id_function

            return id_function(self.source_columns(text_column), vocab_size)
        return self.text_encoder(tokenizer, text_column, conversation)

    def text_encoder(self, tokenizer: Any, text_column: str, conversation: Any):  # subclass
        raise NotImplementedError

    def features(self):
        """The ``datasets.Features`` of :meth:`encoder`'s columns."""
        from lightning_seqmem.data.encode import token_features

        return token_features(tuple(self.parts.values()))

    # -------------------------------------------------------------------------------------------- map-style
    def documents(self, ds: Any) -> Documents:
        """The token views of ``ds``'s columns, empty documents left out."""
        parts = {name: view_of_dataset(ds, column) for name, column in self.parts.items()}
        labels = self.label_view(ds)
        lengths = sum(source.lengths for source in parts.values())
        keep = self.kept_documents(lengths)
        empty = len(lengths) - len(keep)
        if empty:
            ds = select_rows(ds, keep, "non-empty")
            parts = {name: source.select(keep) for name, source in parts.items()}
            labels = labels.select(keep) if labels is not None else None
        return Documents(ds, self, parts, labels, empty)

    def label_view(self, ds: Any) -> Any:
        """The rows' own labels (``None``: labels follow from the kind)."""
        return None

    def kept_documents(self, lengths: np.ndarray) -> np.ndarray:
        """Which documents are not empty (the others are skipped and counted)."""
        return np.flatnonzero(lengths > 0)

    def prepare(self, split: str, docs: Documents, strategy: Strategy, settings: Any) -> PreparedSplit:
        """Truncate or pack ``docs`` with ``strategy`` and count every token that will not reach the model
        (``settings``: the DataModule's ``SeqMemSettings``)."""
        lengths, max_length = docs.lengths, settings.batching.max_length
        if split == "train" and len(lengths) == 0:
            raise ValueError("Every training document is empty after tokenization: there is nothing to train on.")
        stats = dict.fromkeys(DOCUMENT_STATS, 0)  # what truncation and packing cut is added below
        stats.update(
            documents=len(lengths),
            empty_documents_skipped=docs.empty,
            tokens=int(lengths.sum()),
            documents_over_max_length=int((lengths > max_length).sum()),
            longest_document=int(lengths.max(initial=0)),
        )
        made = self.split_rows(split, docs, strategy, settings)
        stats.update(made.stats)
        planned = strategy.rows(made.source, made.labels)
        for key, value in planned.stats.items():
            stats[key] += value  # adds to what the kind cut
        stats.update(epoch_stats(strategy, planned.lengths, split).counts())
        self.finish_stats(stats, planned.lengths)
        warnings = made.warnings + lost_tokens(split, stats, strategy, max_length, self.lost_tokens_fix(strategy))
        infos = [f"[lightning_seqmem] {split}: skipped {docs.empty} empty documents."] if docs.empty else []
        return PreparedSplit(made.dataset, planned.rows, planned.lengths, made.labels, stats, warnings, infos)

    def split_rows(self, split: str, docs: Documents, strategy: Strategy, settings: Any) -> SplitRows:  # subclass
        raise NotImplementedError

    def finish_stats(self, stats: dict[str, Any], row_lengths: np.ndarray) -> None:
        """Statistics that need the planned rows."""

    def tokenizer_stats(self, tokenizer: Callable[[], Any]) -> dict[str, Any]:
        """Statistics about how the tokenizer (``tokenizer()``: loaded only when asked) encoded this kind."""
        return {}

    def lost_tokens_fix(self, strategy: Strategy) -> str:
        """How to keep the tokens ``max_length`` takes."""
        return strategy.lost_tokens_fix(False)

    # --------------------------------------------------------------------------------------------- streamed
    def stream_encoder(self, tokenizer: Any, settings: Any, strategy: Strategy, split: str) -> StreamEncoder:
        """``encode(index, example, counts)`` for a stream of this kind: the map function on the one example,
        then :meth:`stream_row`."""
        return StreamEncoder(self, tokenizer, settings, strategy, split)

    def stream_row(self, row: dict, index: Any, settings: Any, strategy: Strategy, counts: Counter):  # subclass
        """One encoded row (:meth:`encoder`'s columns) to what ``StreamingPacker`` takes (``[]``: skipped),
        truncated as the map-style rows are, what is cut added to ``counts``."""
        raise NotImplementedError


class StreamEncoder:
    """What :meth:`Kind.stream_encoder` returns: a picklable ``encode(index, example, counts)`` (loader workers
    get a copy; each makes its own map function, a closure, on its first example)."""

    def __init__(self, kind: Kind, tokenizer: Any, settings: Any, strategy: Strategy, split: str) -> None:
        self.kind, self.tokenizer, self.settings, self.strategy, self.split = kind, tokenizer, settings, strategy, split
        self.columns = kind.source_columns(settings.data.text_column)
        self.fn = None

    def __getstate__(self) -> dict[str, Any]:
        return dict(vars(self), fn=None)

    def __call__(self, index: int, example: dict, counts: Counter | None = None):
        counts = Counter() if counts is None else counts
        if self.fn is None:
            vocab = len(self.tokenizer) if self.tokenizer is not None and self.kind.pretokenized else None
            self.fn = self.kind.encoder(
                self.tokenizer, self.settings.data.text_column, self.settings.conversation, vocab
            )
        encoded = self.fn({c: [example.get(c)] for c in self.columns}, [index], self.split)
        row = {key: values[0] for key, values in encoded.items()}
        return self.kind.stream_row(row, index, self.settings, self.strategy, counts)
