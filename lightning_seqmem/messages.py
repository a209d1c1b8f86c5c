"""Error messages quote user data bounded: a list of 2,000 texts must not become a 500 KB exception."""

from __future__ import annotations

import reprlib
from typing import Any

_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict, _SHORT.maxlevel = 80, 80, 3, 3, 3, 2


def short_repr(value: Any) -> str:
    """``repr(value)`` cut to about 80 characters and 3 items.

    Example::

        >>> short_repr(["a long document"] * 1000)
        "['a long document', 'a long document', 'a long document', ...]"
    """
    return _SHORT.repr(value)


def check_choice(name: str, value: Any, choices: tuple) -> None:
    """Raise a ``ValueError`` naming the setting and its valid choices when ``value`` is not one of them."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; use one of {choices}.")
