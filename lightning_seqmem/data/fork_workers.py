"""Run one function over many tasks in a few worker processes, and stop them all at the first error.

``multiprocessing.Pool`` is the obvious tool, but when a task raises, leaving its ``with`` block terminates the pool,
and termination first takes the task queue's lock — which an idle worker holds while it waits for a task. On a
loaded machine that stalled for minutes before the user saw the error. Here every worker has its own pipe and its
own fixed share of the tasks, so there is no shared lock: the first error kills the other workers and is raised at
once, naming what the task said.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from collections.abc import Callable, Iterator
from typing import Any


def _work(fn: Callable[[Any], Any], tasks: list[tuple[int, Any]], conn) -> None:
    """A worker: run ``fn`` on each of its tasks, sending ``(index, "ok", result)`` or one ``"error"`` and stop."""
    try:
        for index, task in tasks:
            conn.send((index, "ok", fn(task)))
    except BaseException as error:  # sent to the parent, which raises it
        try:
            conn.send((-1, "error", error))
        except Exception:  # an exception that does not pickle: its text and traceback instead
            conn.send((-1, "error", RuntimeError(f"{error!r}\n{traceback.format_exc()}")))
    finally:
        conn.close()


def run_in_workers(fn: Callable[[Any], Any], tasks: list[Any], processes: int) -> Iterator[tuple[int, Any]]:
    """Yield ``(task index, fn(task))`` as workers finish them (any order); ``fn`` and the tasks reach forked
    workers without pickling (``fn`` may close over a dataset). Re-raises a worker's exception as soon as it
    arrives, after killing every worker; a worker that dies without a word is a ``RuntimeError``.

    Task ``i`` goes to worker ``i % processes``, so uneven tasks still spread when there are more tasks than
    workers (the caller makes several per worker)."""
    context = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else None)
    workers, pipes = [], []
    try:
        for w in range(min(processes, len(tasks))):
            receive, send = context.Pipe(duplex=False)
            share = [(i, t) for i, t in enumerate(tasks) if i % processes == w]
            worker = context.Process(target=_work, args=(fn, share, send), daemon=True)
            worker.start()
            send.close()  # the worker holds the only sending end: its exit closes the pipe
            workers.append(worker), pipes.append(receive)
        waiting = dict(zip(pipes, workers))
        while waiting:
            for conn in mp.connection.wait(list(waiting)):
                try:
                    index, status, value = conn.recv()
                except EOFError:  # this worker is done, or died
                    worker = waiting.pop(conn)
                    worker.join()
                    if worker.exitcode:
                        raise RuntimeError(
                            f"A worker process died (exit code {worker.exitcode}) before finishing its tasks; "
                            "run with num_proc=1 to see the error in this process."
                        ) from None
                    continue
                except Exception as error:  # a result or exception that does not unpickle here
                    raise RuntimeError(f"A worker's answer could not be read: {error!r}") from error
                if status == "error":
                    raise value
                yield index, value
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.kill()
        for worker in workers:
            worker.join(timeout=5)
        for conn in pipes:
            conn.close()
