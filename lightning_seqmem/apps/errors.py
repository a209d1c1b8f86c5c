"""Which errors an entry point prints as a message alone, and which keep their traceback.

A *user's mistake* is an error our input checks raise on purpose: an exception of an input-error class
(:data:`INPUT_ERRORS`: ``ValueError``, ``TypeError``, ``FileNotFoundError``, ``ImportError`` for a missing extra, ...)
whose innermost frame is a ``raise`` statement inside ``lightning_seqmem``, or Lightning's
``MisconfigurationException`` wherever it is raised (Lightning's own word for a bad setting). Hydra's
``InstantiationException`` is looked through to the error it wraps. Anything else — a ``TypeError`` Python raises on a
line of ours, a ``ValueError`` from inside numpy — is a bug, and keeps its whole traceback so it can be reported.
``HYDRA_FULL_ERROR=1`` shows every traceback, mistakes included.
"""

from __future__ import annotations

import linecache
import os
import sys
from collections.abc import Callable
from typing import Any

from hydra.errors import CompactHydraException, InstantiationException

__all__ = [
    "INPUT_ERRORS",
    "UserMistake",
    "exit_on_user_mistake",
    "for_hydra",
    "hydra_spelling",
    "message",
    "user_mistake",
]

INPUT_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, LookupError, OSError, ImportError)
"""The classes our checks raise for bad input (``OSError`` covers ``FileNotFoundError`` and its kin)."""
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL_ERROR = "HYDRA_FULL_ERROR"


class UserMistake(CompactHydraException):
    """A user's mistake on its way out of a Hydra app: Hydra prints its message alone and exits with status 1."""


def _raised_by_our_check(err: BaseException) -> bool:
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
    if not filename.startswith(PACKAGE_DIR + os.sep):
        return False
    return linecache.getline(filename, tb.tb_lineno).lstrip().startswith("raise")


def user_mistake(err: BaseException) -> BaseException | None:
    """The error that says what the user got wrong (``err``, or the one Hydra's instantiate wrapped), or ``None`` for
    a bug (see the module docstring for the rule)."""
    while isinstance(err, InstantiationException) and err.__cause__ is not None:
        err = err.__cause__
    if type(err).__name__ == "MisconfigurationException":  # Lightning's and Fabric's, without importing either
        return err
    if isinstance(err, INPUT_ERRORS) and _raised_by_our_check(err):
        return err
    return None


def message(err: BaseException) -> str:
    """What is printed for a mistake: its message (its class name too, when the message is empty)."""
    text = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
    return text or type(err).__name__


def _node(err: BaseException, default: str | None) -> str | None:
    """The config node whose instantiation failed (Hydra's ``full_key: data``), else ``default``."""
    import re

    while isinstance(err, InstantiationException):
        found = re.search(r"full_key: ([\w.]+)", str(err))
        if found:
            return found[1]
        err = err.__cause__
    return default


def _data_node(err: BaseException) -> str | None:
    """``"data"`` for a mistake raised by the DataModule's code while the Trainer runs it (a checkpoint's data
    refused at ``load_state_dict``), so its message is spelt ``data.<key>=``; else ``None``."""
    tb, inside = err.__traceback__, False
    while tb is not None:
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        inside = inside or path.startswith(os.path.join(PACKAGE_DIR, "datamodule") + os.sep)
        tb = tb.tb_next
    return "data" if inside else None


def for_hydra(err: BaseException, cfg: Any = None, node: str | None = None) -> BaseException:
    """What a Hydra task raises for ``err``: a :class:`UserMistake` carrying the message (the original chained, for
    ``HYDRA_FULL_ERROR=1``) for a user's mistake, ``err`` itself otherwise. With the composed ``cfg``, the message
    is in the Hydra spelling of the node that failed (``InstantiationException``'s, else ``node``)."""
    mistake = user_mistake(err) if isinstance(err, Exception) else None
    if mistake is None:
        return err
    text, where = message(mistake), _node(err, node) or _data_node(mistake)
    keys = cfg.get(where) if cfg is not None and where is not None and "." not in where else None
    if hasattr(keys, "keys"):
        text = hydra_spelling(text, keys.keys(), where)
    reported = UserMistake(text)
    reported.__cause__ = err
    return reported


def exit_on_user_mistake(main: Callable[[], Any]) -> Any:
    """Run a non-Hydra entry point: a user's mistake prints ``error: <message>`` on stderr and exits with status 1
    (its traceback with ``HYDRA_FULL_ERROR=1``, as for the Hydra apps); anything else propagates."""
    try:
        return main()
    except Exception as err:
        mistake = user_mistake(err)
        if mistake is None or os.environ.get(FULL_ERROR) == "1":
            raise
        print(f"error: {message(mistake)}", file=sys.stderr)
        sys.exit(1)


def hydra_spelling(text: str, keys: Any, node: str) -> str:
    """A message written for Python (``Pass text_column=<name> to SeqMemDataModule``) in the Hydra spelling of the
    config node ``node`` whose ``keys`` it names (``Pass data.text_column=<name>``); an argument written inside a
    call (``SeqMemDataModule(cache_dir=...)``) is left as it is."""
    import re

    names = sorted((str(k) for k in keys), key=len, reverse=True)
    if not names:
        return text
    text = re.sub(r" to (SeqMemDataModule|CausalLM|DPO)\b(?!\()", "", text)
    pattern = r"(?<![\w.(=])(" + "|".join(map(re.escape, names)) + r")="
    return re.sub(pattern, rf"{node}.\1=", text)
