"""Each batching strategy with its own options: :class:`Pad`, :class:`Truncate`, :class:`Pack`.

A loader's batching is one of these frozen objects, holding only the options that mean something for it (as
Lightning's ``DDPStrategy(find_unused_parameters=...)`` holds its own), checked once, where they are declared:
``Literal`` choices, bool flags and integer minimums are read from each field's declaration (``fields.py``), and an
option given to the wrong strategy is refused with the strategy it belongs to. What every strategy shares
(``max_length``, batch sizes, the token budget, truncation limits, ``drop_last``) stays in ``BatchingSettings``.

Built the same way from Python, Hydra (``conf/batching/*.yaml``, ``_target_``) and LightningCLI
(``--data.batching=Pack --data.batching.method=wrapped``)::

    SeqMemDataModule(batching=Pack(method="bfd", overflow="split"), eval_batching=Pad())

The strategy objects that do the work (``strategies.py``) are built from these; the planner compares them.
No torch import.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

from lightning_seqmem.batching.fields import check_flags, check_integers, check_literals, decides_rows, integer
from lightning_seqmem.batching.packed_rows import OVERFLOWS, PACKINGS


class Batching:
    """How one loader makes batches of its rows: :class:`Pad`, :class:`Truncate` or :class:`Pack` (the type of
    ``SeqMemDataModule``'s ``batching`` and ``eval_batching``). Its facts are known before any data are read."""

    name: ClassVar[str]
    """The shorthand that selects it with its defaults (``strategy="pack"``), and its name in messages."""
    packs: ClassVar[bool] = False
    """Several documents per row."""
    full_length_rows: ClassVar[bool] = False
    """Every row is ``max_length`` long (a token budget then fixes the rows per batch)."""
    shown: ClassVar[tuple[str, ...]] = ()
    """Fields its short form (``repr``, the planner's table) always shows, defaults included."""

    def __post_init__(self) -> None:
        check_integers(self)
        check_flags(self)
        check_literals(self, type(self).__name__)

    @property
    def label(self) -> str:
        """For reports (the run summary's ``strategy``): its :attr:`spelling`, ``"pad"``, ``"pack_bfd"``."""
        return self.spelling

    @property
    def base_name(self) -> str:
        """Its name in the one vocabulary of :data:`NAMES` (``conf/batching``'s options): ``"pad"``, ``"pack_bfd"``."""
        return self.name

    @property
    def spelling(self) -> str:
        """Its name with the options that differ from that name's defaults, as :func:`as_batching` reads it back and
        ``seqmem-plan`` prints it: ``"pack_bfd"``, ``"pad(to_max_length=True)"``."""
        named = NAMES[self.base_name]
        given = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != named.get(f.name, f.default)
        ]
        return f"{self.base_name}({', '.join(given)})" if given else self.base_name

    def __repr__(self) -> str:
        """The options that differ from their defaults (and ``shown``): ``Pack(method='bfd', overflow='drop')``."""
        given = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if f.name in self.shown or getattr(self, f.name) != f.default
        ]
        return f"{type(self).__name__}({', '.join(given)})"

    def as_dict(self) -> dict[str, Any]:
        """Plain values for loggers and checkpoints (``hparams``): ``{"strategy": "pack", "method": "bfd", ...}``."""
        return {"strategy": self.name, **{f.name: getattr(self, f.name) for f in fields(self)}}

    def signature(self) -> dict[str, Any]:
        """Its options declared to decide the train rows and batches (``decides_rows``), with ``strategy``."""
        return {
            "strategy": self.name,
            **{f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("signature")},
        }


def _options(cls: type[Batching]) -> type[Batching]:
    """A frozen, keyword-only dataclass whose ``__init__`` refuses an option of another strategy by naming the
    strategy it belongs to (Python alone would only say "unexpected keyword argument")."""
    cls = dataclass(frozen=True, kw_only=True, repr=False)(cls)
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, **options: Any) -> None:
        mine = [f.name for f in fields(cls)]
        for option in options:
            if option not in mine:
                raise TypeError(_not_an_option(cls, option, mine))
        init(self, **options)

    cls.__init__ = __init__
    return cls


def _not_an_option(cls: type[Batching], option: str, mine: list[str]) -> str:
    owners = [other.__name__ for other in BY_NAME.values() if option in {f.name for f in fields(other)}]
    where = f": it is an option of {' and '.join(owners)} (e.g. batching={owners[0]}({option}=...))" if owners else ""
    return f"{cls.__name__} has no option {option!r}{where}. {cls.__name__}'s options: {', '.join(mine) or 'none'}."


@_options
class Pad(Batching):
    """Each batch padded to its longest row (rows cut at ``max_length``); one document per row.

    Raises:
        ValueError: a value outside its range; TypeError: an option of another strategy.
    """

    name = "pad"

    to_multiple_of: int | None = integer(8, 1, " or None", optional=True)
    """Padded length rounded up to a multiple of this (8 suits tensor cores); ``None``: the longest row's length."""
    to_max_length: bool = False
    """Every batch ``[rows, max_length]`` (one shape, so the CUDA allocator reuses its blocks)."""
    group_by_length: bool = decides_rows(False)
    """Batches of similar lengths (mega-batches sorted by length, the longest batch first): less padding."""


@_options
class Truncate(Batching):
    """Every row cut and padded to ``max_length``: one constant shape ``[rows, max_length]`` (the static-shape
    baseline). Its cut follows the shared ``truncation_side``; it has no options of its own."""

    name = "truncate"
    full_length_rows = True


@_options
class Pack(Batching):
    """Documents packed into rows of ``max_length`` (no padding between them; ``position_ids`` restart for every
    document, no ``attention_mask``), planned once per split.

    Raises:
        ValueError: a value outside its choices, or ``allow_split_prompt_completion`` without ``overflow="split"``;
            TypeError: an option of another strategy.
    """

    name = "pack"
    packs = True
    full_length_rows = True
    shown = ("method",)

    method: Literal[PACKINGS] = decides_rows("bfd")
    """``"bfd"``: best-fit decreasing over the whole split (documents kept whole where they fit, fewest rows);
    ``"wrapped"``: concatenate and cut every ``max_length`` tokens (documents may span rows)."""
    overflow: Literal[OVERFLOWS] | None = decides_rows(None)
    """A document longer than ``max_length``: ``"split"`` (pieces, nothing lost), ``"truncate"``, ``"drop"`` or
    ``"error"``. ``None``: ``"split"`` for text, ``"truncate"`` for prompt/completion rows and conversations (a
    piece of an example without its prompt would train on an answer to nothing)."""
    allow_split_prompt_completion: bool = False
    """With ``overflow="split"``, split prompt/completion rows too (later pieces lose their prompt): refused
    without this explicit opt-in."""
    cu_seqlens: bool = False
    """Also yield ``cu_seqlens`` (1-D int32) for custom varlen attention kernels."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.allow_split_prompt_completion and self.overflow != "split":
            raise ValueError(
                f"Pack(allow_split_prompt_completion=True) only applies to overflow='split' (got "
                f"overflow={self.overflow!r}); set overflow='split' too, or leave allow_split_prompt_completion out."
            )

    @property
    def base_name(self) -> str:
        return f"{self.name}_{self.method}"

    def overflow_for(self, default: str) -> str:
        """The overflow rule: ``overflow``, else ``default``, the data kind's own (``kinds.Kind.default_overflow``:
        ``"split"`` for text, ``"truncate"`` for prompt/completion rows and for conversations, which arrive already
        cut to max_length by whole turns). The kind passes its rule in: ``batching`` sits below ``kinds``."""
        return self.overflow if self.overflow is not None else default


BY_NAME: dict[str, type[Batching]] = {cls.name: cls for cls in (Pad, Truncate, Pack)}
STRATEGIES = tuple(BY_NAME)
"""The class names: ``"pad"``, ``"truncate"``, ``"pack"``."""
NAMES: dict[str, dict[str, Any]] = {
    "pad": {},
    "truncate": {},
    "pack_bfd": {"method": "bfd"},
    "pack_wrapped": {"method": "wrapped"},
}
"""The one vocabulary of batchings: the ``conf/batching`` options (``batching=pack_wrapped``), ``strategy=`` in
Python and LightningCLI, ``plan.strategies`` and the planner's table; each name's options (``pack`` is ``pack_bfd``)."""
ALIASES = {"pack": "pack_bfd"}


def _class_of(name: str) -> type[Batching]:
    return BY_NAME[name.split("_")[0]]


def _parse_name(value: str, option: str) -> Batching:
    """``"pack_wrapped"`` or ``"pad(to_max_length=True)"`` (Hydra's ``true``/``null`` too) as its object."""
    import ast
    import difflib

    text = value.strip()
    name, _, rest = text.partition("(")
    name = ALIASES.get(name.strip(), name.strip())
    if name not in NAMES or (rest and not rest.endswith(")")):
        close = difflib.get_close_matches(name, [*NAMES, *ALIASES], n=1, cutoff=0.6)
        raise ValueError(
            f"Unknown {option} {value!r}; choose one of {list(NAMES)} ('pack' is 'pack_bfd'), options in brackets "
            "('pad(to_max_length=True)'), or pass an object: Pad(...), Truncate() or Pack(...)."
            + (f" Did you mean {close[0]!r}?" if close else "")
        )
    options = dict(NAMES[name])
    if rest:
        words = {"true": True, "false": False, "null": None, "none": None}
        try:
            call = ast.parse(f"f({rest[:-1]})", mode="eval").body
            if call.args:
                raise ValueError("positional")
            for keyword in call.keywords:
                node = keyword.value
                is_word = isinstance(node, ast.Name) and node.id.lower() in words
                options[keyword.arg] = words[node.id.lower()] if is_word else ast.literal_eval(node)
        except (SyntaxError, ValueError) as err:
            raise ValueError(
                f"Cannot read the options of {option} {value!r}: write them as name=value, e.g. "
                f"'{name}(to_max_length=True)' ({err})."
            ) from None
    return _class_of(name)(**options)


def as_batching(value: Batching | str | Mapping[str, Any], option: str = "strategy") -> Batching:
    """``value`` as a batching object: a name of :data:`NAMES` becomes that batching (``"pack_wrapped"`` ->
    ``Pack(method="wrapped")``, ``"pack"`` -> ``Pack()``; options in brackets as :attr:`Batching.spelling` writes
    them), and the plain values :meth:`Batching.as_dict` saved (``hparams``, checkpoints) the object again, so
    ``SeqMemDataModule(**dm.hparams)`` builds the same DataModule; ``option`` names the argument in the message."""
    if isinstance(value, Batching):
        return value
    if isinstance(value, Mapping) and value.get("strategy") in BY_NAME:
        options = dict(value)
        return BY_NAME[options.pop("strategy")](**options)
    if isinstance(value, str):
        return _parse_name(value, option)
    raise ValueError(
        f"Unknown {option} {value!r}; choose one of {list(NAMES)} ('pack' is 'pack_bfd'), or pass an object: "
        "Pad(...), Truncate() or Pack(...)."
    )
