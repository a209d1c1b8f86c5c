"""``data.fork_workers.run_in_workers``: every task's result once, and the first error stops every worker at once
(``multiprocessing.Pool`` stalled for minutes in its termination on a loaded machine before raising)."""

from __future__ import annotations

import os
import time

import pytest

from lightning_seqmem.data.fork_workers import run_in_workers


def _square(x):
    return x * x


def test_every_task_answered_once_with_its_index():
    got = dict(run_in_workers(_square, list(range(11)), processes=3))
    assert got == {i: i * i for i in range(11)}


def _fail_or_sleep(task):
    kind, path = task
    if kind == "fail":
        raise TypeError("Row 33 of split 'train', column 'text' is NoneType")
    with open(path, "w") as out:  # the busy worker says who it is, then works for a long time
        out.write(str(os.getpid()))
    time.sleep(120)


def test_first_error_is_raised_and_busy_workers_are_stopped(tmp_path):
    pid_file = tmp_path / "busy.pid"
    start = time.monotonic()
    with pytest.raises(TypeError, match="Row 33 of split 'train'"):
        for _ in run_in_workers(_fail_or_sleep, [("sleep", pid_file), ("fail", None)], processes=2):
            pass
    assert time.monotonic() - start < 60  # not after the busy worker's 120 s
    if pid_file.exists():  # the busy worker had started: it must be gone, not left running
        pid = int(pid_file.read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _die(task):
    os._exit(3)


def test_a_worker_that_dies_silently_is_an_error():
    with pytest.raises(RuntimeError, match="exit code 3"):
        list(run_in_workers(_die, [1, 2], processes=2))
