"""A console script's process: its imports without the cyclic garbage collector, its exit without the collector's
last pass over them, or without the interpreter's teardown.

A command such as ``seqmem-plan`` spends most of its time importing torch, Lightning, transformers and datasets
(about 6 CPU-seconds on one core) and then works for a few seconds. Under Python 3.11 two costs come with that
import graph and change nothing the command computes:

- the cyclic collector runs a full pass over the growing module graph again and again while it is imported (about
  1.3 CPU-seconds for these packages); paused while importing, the objects then moved to the permanent generation
  (``gc.freeze``), later passes no longer walk them;
- at exit the interpreter tears that graph down module by module (about 1.5 CPU-seconds), although the operating
  system frees the process's memory at once.

:func:`pause_gc` (until :func:`resume_gc`) takes the first away. The second is nearly all the collector's last pass
over every object still alive (1.5 of 1.7 CPU-seconds measured), and in a process forked from one that had imported
it all (an ``srun`` task, a rank) that pass also copies every page it reads: about 6 CPU-seconds per task, measured
on four ``seqmem-train`` tasks on two cores. Two ways out, one per kind of command:

- :func:`freeze_for_teardown` (``seqmem-train``, ``seqmem-cli``): the collector's last pass walks nothing, and the
  rest of the exit runs as usual: non-daemon threads joined, streams flushed, the C libraries' own exit handlers
  (Gloo, CUDA). What it gives up: objects still alive at the end are no longer finalized (their ``__del__`` does
  not run; a module's globals are in a cycle with its functions, so only that pass reached them). Python does not
  promise it either: what must happen at exit belongs in an ``atexit`` handler, and that is where Lightning's
  loggers (closed at the end of ``fit`` too), ``logging``, ``multiprocessing`` and ``weakref.finalize`` (temporary
  folders) put theirs.
- :func:`leave_now` (``seqmem-plan``, whose work ends with its output): no teardown at all. It still runs what a
  normal exit runs first (the ``atexit`` handlers: log files flushed and closed, temporary folders removed; standard
  streams flushed), then ``os._exit``.

Each acts only in the process that the script itself started: called from a test or a notebook, none does anything.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading
from collections.abc import Callable

_PAUSED: list[bool] = []  # set while pause_gc holds the collector off


def pause_gc(entry: Callable) -> None:
    """Hold the cyclic collector off while ``entry``, the command's main function, imports its packages (until
    :func:`resume_gc`). Not the process's main function (a test calling it), or the collector already off: nothing
    is changed."""
    if is_process_entry(entry) and gc.isenabled() and not _PAUSED:
        gc.disable()
        _PAUSED.append(True)


def resume_gc() -> None:
    """After :func:`pause_gc`: move every object alive (the imported modules, the command's settings) into the
    permanent generation (``gc.freeze``), so that later passes do not walk them, and collect as before, for the
    command's own work (its data read, its traces). Without a pause: nothing."""
    if _PAUSED:
        _PAUSED.clear()
        gc.freeze()
        gc.enable()


def is_process_entry(entry: Callable) -> bool:
    """Whether ``entry`` is the main function of this process: what a console script's ``__main__`` (``from
    module import main; sys.exit(main())``) or ``python -m module`` calls, not a function a test calls in-process."""
    return getattr(sys.modules.get("__main__"), entry.__name__, None) is entry


def freeze_for_teardown(entry: Callable) -> None:
    """Once ``entry`` (the process's main function) has done its work and is about to return: move every object
    into the permanent generation (``gc.freeze``): the interpreter's exit still runs, but its collector pass walks
    none of them. Not the process's main function (a test calling it): nothing."""
    if is_process_entry(entry):
        gc.freeze()


def leave_now(entry: Callable, status: int = 0) -> None:
    """End the process with ``status`` once ``entry`` (its main function) has done its work, without the
    interpreter's teardown: the ``atexit`` handlers run, the standard streams are flushed, then ``os._exit``.
    Returns without doing anything when ``entry`` is not the process's main function, or when a thread other than
    the main one is still running (a normal exit waits for it)."""
    if not is_process_entry(entry):
        return
    if any(t is not threading.main_thread() and not t.daemon for t in threading.enumerate()):
        return
    atexit._run_exitfuncs()  # what a normal exit runs before the teardown, in the same order
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe: nothing more to say
            stream.flush()
    os._exit(status)
