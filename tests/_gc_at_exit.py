"""What the cyclic collector has left to do when a console script's process exits, told by a ``sitecustomize`` on
the child's path: its ``atexit`` handler is registered before anything else, so it runs last, just before the
interpreter's teardown (apps/short_process.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from _site_hook import site_hook_path

HOOK = """
import atexit, gc, os

def _note():
    with open(os.environ["SEQMEM_TEST_GC_NOTE"], "w") as f:
        f.write(f"{len(gc.get_objects())} {gc.get_freeze_count()} {gc.get_stats()[2]['collections']}")

atexit.register(_note)
"""


class GcAtExit(NamedTuple):
    walked: int  # objects the teardown's collector pass would walk
    frozen: int  # objects in the permanent generation, which it skips
    full_collections: int  # full passes over the whole process's life


def noting_env(tmp_path: Path) -> tuple[dict, Path]:
    """The environment for a child whose exit is noted, and the file it notes to."""
    note = tmp_path / "gc_note"
    path = site_hook_path(tmp_path / "gc_hook", HOOK)
    return {**os.environ, "PYTHONPATH": path, "SEQMEM_TEST_GC_NOTE": str(note)}, note


def read_note(note: Path) -> GcAtExit:
    return GcAtExit(*map(int, note.read_text().split()))
