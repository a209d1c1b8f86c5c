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


class ForkedMain:
    """A console script's ``main()`` running in a forked child (``start_forked_main``): poll it, signal it, wait for
    it, as a ``subprocess.Popen`` of the script would be used."""

    def __init__(self, pid: int, argv: list, tmp: tempfile.TemporaryDirectory, paths: list):
        self.pid, self.args, self._tmp, self._paths = pid, argv, tmp, paths
        self.returncode = None

    def poll(self):
        """The exit status once the child has ended, else ``None``."""
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def wait(self, timeout: float = 300) -> subprocess.CompletedProcess:
        """Wait for the child (killed, and ``TimeoutExpired``, past ``timeout``); its status, stdout and stderr."""
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                self._tmp.cleanup()
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        out, err = (open(path).read() for path in self._paths)
        self._tmp.cleanup()
        return subprocess.CompletedProcess(self.args, self.returncode, out, err)


def _own_log_streams() -> None:
    """Log handlers made at import time (Lightning's ``StreamHandler`` on ``lightning.pytorch``) hold the test
    process's stderr, which pytest captures; point them at this process's own, and drop pytest's capturing handlers,
    as a script started from a shell would have them."""
    import logging

    loggers = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    for logger in loggers:
        for handler in list(logger.handlers):
            if type(handler).__module__.startswith("_pytest"):
                logger.removeHandler(handler)
            elif type(handler) is logging.StreamHandler:
                out = getattr(handler.stream, "name", None) in (1, "<stdout>") or handler.stream is sys.__stdout__
                # Not setStream: it flushes the old stream, and an earlier test's capture (capsys) may have closed
                # it; that failed the child before main() ran, with nothing said.
                handler.stream = sys.stdout if out else sys.stderr


def run_forked_main(main, argv, cwd, env=None, timeout=300):
    """``start_forked_main`` and wait for it: a ``subprocess.CompletedProcess`` with ``returncode``, ``stdout`` and
    ``stderr`` as text."""
    return start_forked_main(main, argv, cwd, env).wait(timeout)


def start_forked_main(main, argv, cwd, env=None) -> ForkedMain:
    """Fork, and in the child: ``cd cwd``, update the environment with ``env``, set ``sys.argv = argv`` and the main
    module to ``main``'s (as ``python -m`` would), send stdout and stderr (file descriptors and ``sys.stdout``/``sys.stderr``) to files, call ``main()`` and exit
    with its status (``SystemExit`` as Python would, an uncaught exception printed and 1). Signals sent to the child
    reach the app's own handlers, as they would reach a script started from a shell."""
    # What a job imports (the package, Lightning, transformers, datasets, Hydra), imported here once per test
    # process so that every child inherits it.
    from _job_imports import import_job_modules

    import_job_modules()

    tmp = tempfile.TemporaryDirectory()
    paths = [os.path.join(tmp.name, "stdout"), os.path.join(tmp.name, "stderr")]
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
            # A shell starts a script with the default signal dispositions, whatever the test process set.
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
            torch.set_num_threads(1)  # the parent's OpenMP pool does not survive a fork
            for fd, path in zip((1, 2), paths):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            sys.stdout = open(1, "w", buffering=1, closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            _own_log_streams()
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
        except BaseException:  # setting the child up failed: say so rather than end with a bare status 1
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(code)
    return ForkedMain(pid, list(argv), tmp, paths)
