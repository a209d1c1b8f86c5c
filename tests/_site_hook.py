"""A ``sitecustomize`` for a test's child processes: code that runs in each of them at start-up, before anything
they import (to note what they do, as ``test_many_nodes_app`` notes who tokenized and ``_gc_at_exit`` what the
collector has left at exit)."""

from __future__ import annotations

import os
from pathlib import Path


def site_hook_path(folder: Path, code: str) -> str:
    """Write ``code`` as ``folder/sitecustomize.py``; the ``PYTHONPATH`` that puts it first for a child, ahead of
    the test process's own."""
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(code)
    return os.pathsep.join([str(folder), *filter(None, [os.environ.get("PYTHONPATH")])])
