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


def describe_source(source: Any, ds: Any = None) -> str:
    """A short name for a dataset argument (a cache entry's data, a node holding other data): the path (made
    absolute) or name given, else the dataset's (``ds``)."""
    import os

    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        return os.path.abspath(text) if text != "builtin" and (os.path.exists(text) or "*" in text) else text
    if isinstance(source, (list, tuple)):
        return f"a list of {len(source)} items"
    info = getattr(ds, "info", None)
    name = getattr(info, "dataset_name", None) or getattr(info, "builder_name", None)
    return name or f"an in-memory dataset of {len(ds) if ds is not None else '?'} rows"


# ------------------------------------------------------------------------------------------------------- spelling
SURFACES = ("python", "hydra", "cli")
_SURFACE_ENV = "LIGHTNING_SEQMEM_SURFACE"  # inherited by the ranks and workers an app starts


def set_surface(surface: str) -> None:
    """Say which surface the user configures this run from, so messages spell a fix the way they would type it:
    ``"python"`` (default: ``SeqMemDataModule(on_resume_mismatch='restart_epoch')``), ``"hydra"`` (``seqmem-train``:
    ``data.on_resume_mismatch=restart_epoch``) or ``"cli"`` (``seqmem-cli``: ``--data.on_resume_mismatch
    restart_epoch``). Kept in the environment so the processes a launcher starts spell alike."""
    import os

    check_choice("surface", surface, SURFACES)
    os.environ[_SURFACE_ENV] = surface


def surface() -> str:
    """The surface set by :func:`set_surface` (``"python"`` when none was)."""
    import os

    value = os.environ.get(_SURFACE_ENV, "python")
    return value if value in SURFACES else "python"


def spell_data_option(name: str, value: Any) -> str:
    """A ``SeqMemDataModule`` argument set to ``value``, as the user types it on the current surface.

    Example::

        >>> spell_data_option("on_resume_mismatch", "restart_epoch")  # surface "python"
        "on_resume_mismatch='restart_epoch'"
    """
    where = surface()
    if where == "hydra":
        text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        return f"data.{name}={text}"
    if where == "cli":
        return f"--data.{name} {'null' if value is None else value}"
    return f"{name}={value!r}"
