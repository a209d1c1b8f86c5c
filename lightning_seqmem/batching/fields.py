"""Fields of the frozen settings classes and their checks, declared once: integer minimums, bool flags and
``Literal`` choices are read from each field's declaration, so every settings class checks them the same way, with
the field's name in the message.
"""

from __future__ import annotations

import functools
import numbers
import typing
from dataclasses import field, fields
from typing import Any, Literal

import numpy as np

from lightning_seqmem.messages import short_repr


def integer(default: Any, minimum: int, hint: str = "", optional: bool = False, signature: bool = False):
    """A dataclass field holding an ``int >= minimum`` (any integral number is accepted and stored as ``int``);
    ``optional``: ``None`` is allowed too. ``signature``: the field decides the train rows and batches (resume)."""
    return field(
        default=default, metadata={"minimum": minimum, "hint": hint, "optional": optional, "signature": signature}
    )


def decides_rows(default: Any):
    """A field (not an integer) that decides the train rows and batches: part of the resume signature."""
    return field(default=default, metadata={"signature": True})


def check_integers(settings: Any) -> None:
    """Check (and store as ``int``) every field declared with :func:`integer`; ``ValueError`` names the rule."""
    for f in fields(settings):
        if "minimum" not in f.metadata:
            continue
        value, minimum = getattr(settings, f.name), f.metadata["minimum"]
        if value is None and f.metadata["optional"]:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
            raise ValueError(f"{f.name} must be an int >= {minimum}{f.metadata['hint']}, got {short_repr(value)}.")
        object.__setattr__(settings, f.name, int(value))


def check_flags(settings: Any) -> None:
    """Refuse a field annotated ``bool`` holding anything but ``True``/``False`` (a string such as ``"false"``
    would switch the option on); ``ValueError`` names the field."""
    for f in fields(settings):
        value = getattr(settings, f.name)
        if f.type in ("bool", bool) and not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{f.name} must be True or False, got {short_repr(value)}.")


@functools.cache
def literal_choices(cls: type) -> dict[str, tuple[tuple, bool]]:
    """``{field: (choices, None allowed)}`` for the fields of ``cls`` annotated ``Literal[...]`` (or
    ``Literal[...] | None``)."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint)
        if typing.get_origin(hint) is Literal:
            out[name] = (args, False)
        else:
            literal = [a for a in args if typing.get_origin(a) is Literal]
            if literal:
                out[name] = (typing.get_args(literal[0]), type(None) in args)
    return out


def check_literals(settings: Any, where: str = "") -> None:
    """Refuse a value outside its field's ``Literal`` choices; the message names the field (``where``: the class,
    as ``Pack(method=...)``) and the choices."""
    for name, (choices, optional) in literal_choices(type(settings)).items():
        value = getattr(settings, name)
        if value is None and optional:
            continue
        if not isinstance(value, str) or value not in choices:
            shown = f"{where}({name}={short_repr(value)})" if where else f"{name}={short_repr(value)}"
            extra = " (or None)" if optional else ""
            raise ValueError(f"{shown} is not valid; use one of {choices}{extra}.")
