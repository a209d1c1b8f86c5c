"""Run a console script's ``main()`` in a forked child of the test process: a process of its own (its exit status,
its stdout and stderr, its logging set-up and warning filters stay in the child), without a fresh interpreter
paying ~7 CPU-s to import torch, Lightning and transformers again.

What it stands for: ``seqmem-train <args>`` started from a shell, whose behaviour the test checks (what the job
writes, its exit status, what it prints). What it does not prove is the entry-point wiring itself (the installed
script, the imports of a fresh interpreter): one test per console script runs the real one in a subprocess.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback


def run_forked_main(main, argv, cwd, env=None, timeout=300):
    """Fork, and in the child: ``cd cwd``, update the environment with ``env``, set ``sys.argv = argv`` and the main
    module to ``main``'s (as ``python -m`` would), send stdout and stderr (file descriptors and ``sys.stdout``/``sys.stderr``) to files, call ``main()`` and exit
    with its status (``SystemExit`` as Python would, an uncaught exception printed and 1).

    Returns a ``subprocess.CompletedProcess`` with ``returncode``, ``stdout`` and ``stderr`` as text.
    """
    # What every run imports, imported here (once per test process) so that the child inherits it.
    import lightning.pytorch  # noqa: F401
    import transformers  # noqa: F401

    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")]
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                import atexit

                import torch

                # A process started from a shell has none of pytest's exit handlers (one would remove the folder
                # that holds this child's output): an app that runs its handlers and leaves early
                # (apps/short_process.leave_now) runs only its own.
                atexit._clear()
                torch.set_num_threads(1)  # the parent's OpenMP pool does not survive a fork
                for fd, path in zip((1, 2), paths):
                    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
                sys.stdout = open(1, "w", buffering=1, closefd=False)
                sys.stderr = open(2, "w", buffering=1, closefd=False)
                os.chdir(cwd)
                os.environ.update(env or {})
                sys.argv = list(argv)
                # As under ``python -m <main's module>``: what a process spawned from here (ddp_spawn, loader
                # workers) re-imports as its main module, and what Lightning's launcher re-runs for another rank.
                sys.modules["__main__"] = sys.modules[main.__module__]
                try:
                    result = main()
                    code = 0 if result is None else result
                except SystemExit as done:
                    code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
                    if not isinstance(done.code, (int, type(None))):
                        print(done.code, file=sys.stderr)
                except BaseException:
                    traceback.print_exc()
                    code = 1
            finally:
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except Exception:
                        pass
                os._exit(code)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired(argv, timeout)
            time.sleep(0.05)
        out, err = (open(path).read() for path in paths)
    return subprocess.CompletedProcess(argv, os.waitstatus_to_exitcode(status), out, err)
