"""``Mix``: several sources read as one training set, each with a weight, decided before packing. No torch import.

A ``Mix`` is only the user's request, checked once: which sources, their normalised weights, what a weight counts
(``by``) and what happens when a source runs out (``exhausted``). The order it promises is made by
``mixing.interleave``; the DataModule reads each source on its own (``datamodule.mix_mode``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lightning_seqmem.messages import check_choice, short_repr

BY = ("tokens", "documents")
EXHAUSTED = ("stop", "repeat")
SOURCE_OPTIONS = ("dataset", "text_column")  # what a source given as a dict may set for itself


@dataclass(frozen=True)
class Source:
    """One source of a mix: what ``SeqMemDataModule(dataset=...)`` takes, and its own ``text_column`` (``None``:
    the DataModule's)."""

    name: str
    dataset: Any = field(repr=False, compare=False)  # a DataFrame's == is elementwise: compared in Mix.__eq__
    text_column: str | None = None


class Mix:
    """Sources mixed by weight: pass it as ``SeqMemDataModule(dataset=Mix(...))``.

    Each source is packed (or padded, or truncated) on its own, and whole rows are interleaved so that every prefix
    of the training order holds each source's share: after any number of rows, source ``s`` has put within one
    row (``max_length`` tokens, or one row's documents with ``by="documents"``) of ``weight[s] * total`` into the
    batches (``mixing.interleave``).

    Args:
        sources: name -> anything ``dataset=`` takes, or a dict ``{"dataset": ..., "text_column": ...}`` for a
            source whose columns differ. Sources of text, prompt/completion and conversations mix; preference pairs
            mix only with preference pairs.
        weights: name -> weight, for every source (normalised to sum 1; ``None``: equal weights).
        by: ``"tokens"`` (default): a weight is a share of the tokens put into rows (after truncation);
            ``"documents"``: a share of the documents (a packed row counts its pieces of documents).
        exhausted: ``"repeat"`` (default): a source that runs out starts again, reshuffled, until every source has
            been read once (``stats()`` says how often each was repeated); ``"stop"``: the epoch ends when the first
            source runs out, and no document is read twice.
        seed: orders each source's rows; ``None``: the DataModule's ``seed``.

    Raises:
        ValueError: an unknown or missing source name in ``weights``, a negative, non-finite or all-zero weight, an
            empty source list, or a misspelt ``by``/``exhausted``; the message names the source.

    Example::

        Mix(sources={"web": "builtin", "code": code_rows}, weights={"web": 0.7, "code": 0.3})
    """

    __slots__ = ("sources", "weights", "by", "exhausted", "seed")
    sources: tuple[Source, ...]
    weights: tuple[float, ...]  # in source order, summing to 1

    def __init__(
        self,
        sources: dict[str, Any],
        weights: dict[str, float] | None = None,
        by: str = "tokens",
        exhausted: str = "repeat",
        seed: int | None = None,
    ) -> None:
        check_choice("Mix(by=...)", by, BY)
        check_choice("Mix(exhausted=...)", exhausted, EXHAUSTED)
        if not isinstance(sources, dict) or not sources:
            raise ValueError(
                f"Mix(sources=...) needs a dict of name -> dataset with at least one source, got {short_repr(sources)}."
            )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"Mix(seed={seed!r}) must be an int or None (the DataModule's seed).")
        parsed = tuple(_source(str(name), value) for name, value in sources.items())
        names = [s.name for s in parsed]
        _check_unique(list(sources))
        object.__setattr__(self, "sources", parsed)
        object.__setattr__(self, "weights", _normalised(names, weights))
        object.__setattr__(self, "by", by)
        object.__setattr__(self, "exhausted", exhausted)
        object.__setattr__(self, "seed", seed)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Mix is frozen: build another Mix instead of setting {name!r}.")

    def __getstate__(self) -> dict[str, Any]:
        """What ``pickle`` and ``copy.deepcopy`` keep (``ddp_spawn`` and loader workers started by ``spawn``)."""
        return {name: getattr(self, name) for name in self.__slots__}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled or copied ``Mix`` past the frozen ``__setattr__`` (as ``__init__`` sets it)."""
        for name in self.__slots__:
            object.__setattr__(self, name, state[name])

    def __eq__(self, other: object) -> bool:
        """Same sources (names, columns, and the same dataset: the same object, or equal names and lists), weights,
        ``by``, ``exhausted`` and seed."""
        return (
            isinstance(other, Mix)
            and all(getattr(self, k) == getattr(other, k) for k in self.__slots__)
            and all(_same(a.dataset, b.dataset) for a, b in zip(self.sources, other.sources))
        )

    def __hash__(self) -> int:
        return hash((self.names, self.weights, self.by, self.exhausted, self.seed))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sources)

    def weight(self, name: str) -> float:
        return self.weights[self.names.index(name)]

    def __repr__(self) -> str:
        shares = ", ".join(f"{n}={w:.3g}" for n, w in zip(self.names, self.weights))
        return f"Mix({shares}, by={self.by!r}, exhausted={self.exhausted!r}, seed={self.seed})"


def _check_unique(keys: list[Any]) -> None:
    """Source names are ``str(key)``: two keys that read alike (``1`` and ``"1"``) would train as one name."""
    seen: dict[str, Any] = {}
    for key in keys:
        if str(key) in seen:
            raise ValueError(
                f"Mix sources {seen[str(key)]!r} and {key!r} are both named {str(key)!r} (a source's name is its key "
                "as a string): give them names that differ."
            )
        seen[str(key)] = key


def _same(a: Any, b: Any) -> bool:
    """The same dataset: one object, equal names or lists, or one ``datasets`` fingerprint (a pickled or copied
    ``Dataset`` keeps it; a DataFrame, whose ``==`` is elementwise, is the same object only)."""
    if a is b or (isinstance(a, (str, list, tuple)) and type(a) is type(b) and a == b):
        return True
    if type(a) is not type(b):
        return False
    fingerprint = getattr(a, "_fingerprint", None)
    return fingerprint is not None and fingerprint == getattr(b, "_fingerprint", None)


def _source(name: str, value: Any) -> Source:
    if isinstance(value, Mix) or (isinstance(value, dict) and isinstance(value.get("dataset"), Mix)):
        raise ValueError(
            f"Mix source {name!r} is itself a Mix: a mix's sources are datasets. Give one Mix of all their sources, "
            "with the weights multiplied out."
        )
    if isinstance(value, Source):
        return Source(name, value.dataset, value.text_column)
    if isinstance(value, dict) and "dataset" in value:
        unknown = sorted(set(value) - set(SOURCE_OPTIONS))
        if unknown:
            raise ValueError(
                f"Mix source {name!r}: unknown options {unknown}; a source given as a dict takes {SOURCE_OPTIONS}."
            )
        return Source(name, value["dataset"], value.get("text_column"))
    if value is None:
        raise ValueError(f"Mix source {name!r} is None; give what SeqMemDataModule(dataset=...) takes.")
    return Source(name, value)


def _normalised(names: list[str], weights: dict[str, float] | None) -> tuple[float, ...]:
    """The weights in source order, summing to 1; every problem named by its source."""
    if weights is None:
        return tuple(1.0 / len(names) for _ in names)
    if not isinstance(weights, dict):
        raise ValueError(f"Mix(weights=...) must be a dict of source name -> weight, got {short_repr(weights)}.")
    unknown = sorted(set(map(str, weights)) - set(names))
    if unknown:
        raise ValueError(f"Mix weights name unknown sources {unknown}; the sources are {names}.")
    missing = [n for n in names if n not in {str(k) for k in weights}]
    if missing:
        raise ValueError(f"Mix weights miss sources {missing}: give every source a weight (0 leaves one out).")
    values = {str(k): v for k, v in weights.items()}
    for name in names:
        w = values[name]
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ValueError(f"Mix weight of source {name!r} is {w!r}; a weight is a finite number >= 0.")
    total = math.fsum(float(values[n]) for n in names)
    if total <= 0:
        raise ValueError(f"Mix weights sum to {total}: at least one source needs a positive weight.")
    return tuple(float(values[n]) / total for n in names)
