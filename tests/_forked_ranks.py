"""Run a function on several ranks in forked processes, as torchrun would start them, for multi-process tests.

A spawned or relaunched rank is a fresh interpreter that imports torch, Lightning and transformers again (~7 CPU-s
each); a forked rank inherits the test process's imports and starts in milliseconds. Each child gets the variables
torchrun sets (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``), so
Lightning's ``strategy="ddp"`` and FSDP see ``LOCAL_RANK`` and join the group instead of relaunching the script, and
plain ``torch.distributed.init_process_group`` finds its rank and peers in the environment.

Nothing may hang: the first rank that fails or dies gets every other rank killed (a rank left alone would wait at
its next collective for Gloo's 30-minute timeout), and so does the time limit. A child never returns into pytest:
it leaves with ``os._exit`` after reporting, so no atexit handler, pytest's or Gloo's teardown, runs in it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import torch


def free_port() -> int:
    """A TCP port nothing listens on now (the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, report) -> None:
    """One forked rank: set torchrun's variables, run ``fn(rank, *args)``, send ``(True, result)`` or
    ``(False, traceback)``, and leave without running any exit handler."""
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
            WORLD_SIZE=str(world),
            OMP_NUM_THREADS="1",
        )
        # Before any torch op: the parent's OpenMP thread pool does not survive fork, and one thread per rank is
        # what two ranks on a small machine should use anyway.
        torch.set_num_threads(1)
        try:
            result = fn(rank, *args)
            if torch.distributed.is_initialized():
                torch.distributed.barrier()  # no rank leaves while another still talks to it
            message = (True, result)
        except BaseException:
            message = (False, traceback.format_exc())
        # Plain pickle: the multiprocessing pickler would hand tensors over in shared memory that this process,
        # about to exit, must still serve.
        report.send_bytes(pickle.dumps(message))
        report.close()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_ranks(fn: Callable[..., Any], *args: Any, world: int = 2, timeout: float = 120) -> list[Any]:
    """Call ``fn(rank, *args)`` in ``world`` forked processes at once and return their results by rank.

    ``fn`` and ``args`` reach the children without pickling; results come back pickled (tensors copied). Raises
    ``AssertionError`` with each failing rank's traceback (or exit code, for a rank that died without a word) and the
    ranks killed: those still running at ``timeout`` seconds, or 3 s after the first failure.
    """
    # A forked rank would inherit the group and its sockets, and join nothing.
    assert not torch.distributed.is_initialized(), (
        "a process group is open in the test process: destroy it before run_ranks"
    )
    context = mp.get_context("fork")
    port = free_port()
    ranks, pending = [], {}
    try:
        for rank in range(world):
            receive, send = context.Pipe(duplex=False)
            # Not a daemon: a rank may start DataLoader workers. Killed in the finally block whatever happens.
            process = context.Process(target=_rank, args=(fn, rank, world, port, args, send))
            process.start()
            send.close()  # the child holds the only sending end: its death closes the pipe
            ranks.append(process)
            pending[receive] = rank
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while pending:
            ready = wait(list(pending), max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for receive in ready:
                rank = pending.pop(receive)
                try:
                    ok, value = pickle.loads(receive.recv_bytes())
                except EOFError:
                    ranks[rank].join(5)
                    ok, value = False, f"died (exit code {ranks[rank].exitcode}) without a report"
                receive.close()
                if ok:
                    results[rank] = value
                else:
                    failures[rank] = value
                    # The others are likely failing because of this one: hear them briefly, then kill them.
                    deadline = min(deadline, time.monotonic() + 3)
        if failures or pending:
            killed = sorted(pending.values())
            lines = [f"rank {rank} failed:\n{text}" for rank, text in failures.items()]  # in the order heard
            if killed:
                why = "after another rank failed" if failures else f"still running after {timeout} s"
                lines.append(f"ranks {killed} killed {why}")
            raise AssertionError("\n".join(lines))
        return [results[rank] for rank in range(world)]
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
        for process in ranks:
            process.join(5)
        for receive in pending:
            receive.close()
