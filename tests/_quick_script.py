"""A fresh interpreter for a test's own ``python -c`` script, where what the script imports, checks or prints is
the point, not how its process starts or ends: its imports run with the cyclic collector paused and it ends without
the interpreter's teardown (exit handlers run and the streams are flushed first), as the console scripts do
(``apps/short_process.py``). About 3 CPU-s less per interpreter that imports Lightning; the script's output is the
same. A test about the exit itself (``test_process_exit.py``) or a console script's own start keeps a plain one."""

from __future__ import annotations

_START = "import gc as _gc\n_gc.disable()  # a short script: its garbage goes with its process\n"
_END = (
    "\nimport atexit as _atexit, os as _os, sys as _sys\n"
    "_atexit._run_exitfuncs()\n"
    "_sys.stdout.flush()\n"
    "_sys.stderr.flush()\n"
    "_os._exit(0)\n"
)


def quick(code: str) -> str:
    """``code`` as a script with the collector off and a short exit (an error still exits 1 with its traceback)."""
    return _START + code + _END
