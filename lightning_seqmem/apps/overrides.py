"""Command-line overrides checked against our config: a misspelt key or group gets "did you mean".

Hydra answers ``data.max_lenght=128`` with "Key 'max_lenght' is not in struct ... To append to your config use
+data.max_lenght=128", advice that then fails in the DataModule. Here an override of a key the config lacks is
refused with the closest key of the same node (or the full path of a key given without it: ``max_length`` ->
``data.max_length``), a group option that does not exist with the closest option, and ``strategy=`` is pointed to
``batching=``. Only what Hydra would refuse is refused (``+key=``, ``++key=``, ``~key`` and ``hydra.*`` are left to
Hydra); the config is composed with the overrides that pick group options, as Hydra will compose it. A console
script runs under :func:`overrides_checked`: group options before Hydra, keys once Hydra's composition has failed.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.resources
import os
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = [
    "check_overrides",
    "config_groups",
    "exit_on_unknown_override",
    "job_started",
    "overrides_checked",
    "unknown_override",
]

CONFIG_MODULE = "lightning_seqmem.conf"
POINTERS = {"strategy": "batching", "eval_strategy": "data.eval_batching", "model_type": "model.model_config"}
"""Names users bring from Python or other tools, and where our config keeps that choice."""


def config_groups() -> dict[str, list[str]]:
    """``{group: [options]}`` of ``conf/`` (``model/lora`` included), from the package's files."""
    groups: dict[str, list[str]] = {}

    def walk(folder, prefix: str) -> None:
        for entry in folder.iterdir():
            if entry.is_dir() and not entry.name.startswith("_"):
                name = f"{prefix}{entry.name}"
                groups[name] = sorted(e.name[:-5] for e in entry.iterdir() if e.name.endswith(".yaml"))
                walk(entry, f"{name}/")

    walk(importlib.resources.files(CONFIG_MODULE), "")
    return groups


def _keys(node: Any, prefix: str = "") -> Iterator[str]:
    from omegaconf import DictConfig

    for key in node.keys() if isinstance(node, DictConfig) else ():
        path = f"{prefix}{key}"
        yield path
        yield from _keys(node._get_node(key), f"{path}.")


def _closest(word: str, choices: Sequence[str]) -> str | None:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def unknown_override(key: str, value: str, cfg: Any, groups: dict[str, list[str]]) -> str | None:
    """The message for ``key=value`` when ``cfg`` (the composed config) has no ``key`` and it names no group;
    ``None`` when Hydra would take it."""
    from omegaconf import DictConfig

    parts = key.split(".")
    node = cfg
    for depth, part in enumerate(parts):
        if not isinstance(node, DictConfig):
            return None  # below a value that is not a mapping (null, a list): Hydra's own message
        if part not in node:
            parent = ".".join(parts[:depth])
            return _message(key, value, parent, part, node, cfg, groups)
        node = node._get_node(part)
    return None


def _message(key: str, value: str, parent: str, part: str, node: Any, cfg: Any, groups: dict[str, list[str]]) -> str:
    where = f"{parent}." if parent else ""
    if not parent and part in POINTERS:
        target = POINTERS[part]
        options = f" (options: {', '.join(groups[target])})" if target in groups else ""
        return f"There is no {key!r} in the config: it is {target}={value}{options}."
    every = list(_keys(cfg))
    ends = [k for k in every if k.endswith(f".{key}")]
    close = _closest(part, [str(k) for k in node.keys()])
    group = _closest(key, list(groups)) if not parent else None
    if close is not None:
        hint = f"did you mean {where}{close}={value}?"
    elif ends:
        hint = f"did you mean {ends[0]}={value}?"
    elif group is not None:
        hint = f"did you mean the group {group}={value} (options: {', '.join(groups[group])})?"
    else:
        near = _closest(key, every)
        hint = (
            f"did you mean {near}={value}?" if near else f"{parent or 'the config'}'s keys: {', '.join(node.keys())}."
        )
    return f"Unknown config key {key!r}: {hint}"


def _group_message(group: str, option: str, groups: dict[str, list[str]]) -> str | None:
    if option in groups[group] or option in ("null", "None"):
        return None
    close = _closest(option, groups[group])
    hint = f"did you mean {group}={close}? " if close else ""
    return f"Unknown option {group}={option}: {hint}{group}'s options: {', '.join(groups[group])}."


def check_overrides(overrides: Sequence[str], config_name: str, keys: bool = True) -> str | None:
    """The message for the first override Hydra would refuse for a key or group option we know a close name of,
    else ``None`` (composition errors of any other kind are left to Hydra). ``keys=False``: group options only,
    which needs no composing."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    try:
        parsed = OverridesParser.create().parse_overrides([o for o in overrides if not o.startswith("-")])
    except Exception:
        return None  # Hydra says what is wrong with the syntax
    groups = config_groups()
    picks, given_keys = [], []
    for o in parsed:
        name = o.key_or_group
        if o.type != OverrideType.CHANGE or o.package is not None or re.split(r"[./]", name)[0] == "hydra":
            continue
        try:
            values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
        except Exception:
            continue  # an interval sweep, a value with no string form: Hydra's to judge
        if name in groups:
            listed = o.value() if not o.is_sweep_override() else None
            for option in [str(v) for v in listed] if isinstance(listed, list) else values:  # logger=[csv,tb]
                message = _group_message(name, option, groups)
                if message:
                    return message
            picks.append(f"{name}={values[0]}")
        else:
            given_keys.append((name, values[0] if values else ""))
    if not keys or not given_keys:
        return None
    cfg = _compose(config_name, picks)
    if cfg is None:
        return None
    for key, value in given_keys:
        message = unknown_override(key, value, cfg, groups)
        if message:
            return message
    return None


def _compose(config_name: str, picks: list[str]) -> Any:
    from hydra import compose, initialize_config_module

    try:
        with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
            return compose(config_name, overrides=picks)
    except Exception:
        return None  # a composition Hydra will refuse with its own message


def exit_on_unknown_override(argv: Sequence[str], config_name: str, keys: bool = True) -> None:
    """Print :func:`check_overrides`' message and exit with status 1 when there is one (console scripts)."""
    message = check_overrides(argv, config_name, keys)
    if message:
        print(message, file=sys.stderr)
        sys.exit(1)


_FULL_ERROR = "HYDRA_FULL_ERROR"
_held = False  # HYDRA_FULL_ERROR is ours, set until the job starts


@contextlib.contextmanager
def overrides_checked(argv: Sequence[str], config_name: str) -> Iterator[None]:
    """Run a Hydra app (the ``with`` body) with its overrides checked: group options before Hydra starts, keys only
    when Hydra's composition fails, then with "did you mean" instead of Hydra's advice to add the key with ``+``.

    Composing the config a second time up front, to look for an unknown key, cost every run (and each rank of a
    multi-process job) a third of a second or more. So until the job starts (:func:`job_started`, the task's first
    call) Hydra raises its errors here instead of printing them (``HYDRA_FULL_ERROR``, unless the user set it):
    a composition error gets our message where we have one, else Hydra's own report, as Hydra prints it. A multirun
    is checked whole up front, as before: it starts once, and Hydra makes its sweep folder before composing a job.
    """
    global _held
    sweep = any(a in ("-m", "--multirun") for a in argv)  # launched once; Hydra writes its folder before composing
    exit_on_unknown_override(argv, config_name, keys=sweep)
    _held = _FULL_ERROR not in os.environ
    if _held:
        os.environ[_FULL_ERROR] = "1"
    try:
        yield
    except Exception as error:
        if not _held:  # the job's own error, or the user asked for full tracebacks
            raise
        job_started()
        exit_on_unknown_override(argv, config_name)
        from hydra._internal.utils import run_and_report

        failed = error  # ``error`` is unbound once the except clause ends

        def again() -> None:
            raise failed

        run_and_report(again)  # prints it as Hydra would have, and exits with status 1
    finally:
        job_started()


def job_started() -> None:
    """The job runs: Hydra handles its errors as it always does (the first line of a Hydra app's task)."""
    global _held
    if _held:
        os.environ.pop(_FULL_ERROR, None)
        _held = False
