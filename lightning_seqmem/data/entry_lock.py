"""One writer per cache entry, on one disk or on a disk many nodes share: a lock file the others wait on.

Each node's first process tokenizes (Lightning's ``prepare_data_per_node``), so on a shared file system every node
would tokenize the same entry at once. The first to create ``writer.lock`` (``O_EXCL``: atomic on local disks,
NFS and Lustre alike) writes the entry; the others wait until its manifest appears and read it. The holder touches
the lock while it works; a lock untouched for ``STALE_LOCK_S`` (its holder was killed) or whose holder is known to
have exited (same host and process-id space, ``cache_dir.process_is_gone``) is broken and taken over.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from lightning_seqmem.data.cache_dir import pid_space, process_is_gone

__all__ = ["LOCK", "STALE_LOCK_S", "entry_writer"]

LOCK = "writer.lock"
HEARTBEAT_S = 5.0  # the holder touches its lock this often
STALE_LOCK_S = 60.0  # a lock untouched this long is a killed holder's (a live one touches it every HEARTBEAT_S)
POLL_S = 0.2  # how often a waiting process looks for the manifest


def _identity() -> dict:
    import socket

    return {"host": socket.gethostname(), "space": pid_space(), "pid": os.getpid(), "since": time.time()}


def _holder(lock: Path) -> tuple[dict, float] | None:
    """The lock's holder and how long ago it last touched the lock; ``None`` when there is no lock."""
    try:
        age = time.time() - lock.stat().st_mtime
        text = lock.read_text()
    except FileNotFoundError:
        return None
    try:
        return json.loads(text), age
    except ValueError:  # being written this instant
        return {}, age


def _is_dead(holder: dict, age: float) -> bool:
    if age > STALE_LOCK_S:
        return True
    try:
        return process_is_gone(holder["host"], holder["space"], int(holder["pid"]))
    except (KeyError, TypeError, ValueError):
        return False


def _break(lock: Path, holder: dict) -> None:
    """Remove a dead holder's lock, unless another writer took it meanwhile (its content then differs)."""
    with suppress(OSError):
        if json.loads(lock.read_text()) == holder:
            lock.unlink()


def _touch_until(lock: Path, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        with suppress(OSError):
            os.utime(lock)


@contextmanager
def entry_writer(directory: Path, done: Callable[[], bool], say: Callable[[str], None]) -> Iterator[bool]:
    """``True`` inside the block when this process must write the entry (it holds the lock); ``False`` when
    ``done()`` became true (another writer finished it) before the lock was free. The lock goes with the block."""
    lock = directory / LOCK
    announced = False
    while True:
        if done():
            yield False
            return
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            found = _holder(lock)
            if found is not None and _is_dead(*found):
                say(f"[lightning_seqmem] Token cache entry {directory}: its writer {found[0]} is gone; taking over.")
                _break(lock, found[0])
            elif found is not None and not announced:
                say(f"[lightning_seqmem] Token cache entry {directory} is being written by {found[0]}; waiting.")
                announced = True
            time.sleep(POLL_S)
            continue
        break
    with os.fdopen(fd, "w") as f:
        json.dump(_identity(), f)
    stop = threading.Event()
    beat = threading.Thread(target=_touch_until, args=(lock, stop), daemon=True)
    beat.start()
    try:
        yield not done()  # finished by another writer between our last look and our lock: nothing to write
    finally:
        stop.set()
        beat.join()
        with suppress(OSError):
            lock.unlink()
