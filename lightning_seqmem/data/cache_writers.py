"""The writers of a token cache entry: one at a time, each with temporary files of its own, and the files of
writers that are gone told from those of live ones.

Each node's first process tokenizes (Lightning's ``prepare_data_per_node``), so on a shared file system every node
would tokenize the same entry at once. The first to create ``writer.lock`` (a link: atomic on local disks, NFS and
Lustre alike) writes the entry; the others wait until its manifest appears and read it. The holder keeps a
``flock`` on the lock and touches it while it works; a lock untouched for ``STALE_LOCK_S`` (its holder was killed,
on any machine) or, on this host, one whose ``flock`` is free (its holder ended, in whatever container) is broken
and taken over. Temporary files carry their writer's ``flock`` the same way (``cache_dir.held_file``), so a
cleaner never removes a live writer's file, even one of a container with the same host name and process id.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from lightning_seqmem.data.cache_dir import held_file, nobody_holds, pid_space, process_is_gone, writer_name

__all__ = ["LOCK", "STALE_LOCK_S", "entry_writer", "file_of_this_writer", "writer_is_gone", "writer_prefix"]

LOCK = "writer.lock"
HEARTBEAT_S = 5.0  # the holder touches its lock this often
STALE_LOCK_S = 60.0  # a lock untouched this long is a killed holder's (a live one touches it every HEARTBEAT_S)
POLL_S = 0.2  # how often a waiting process looks for the manifest
_TMP_NAME = re.compile(
    r"^(?:tokens-[0-9a-f-]+\.arrow|manifest\.json)\.(?P<host>.+)\.(?P<space>[0-9a-f]{12})-(?P<pid>\d+)\.[^.]+\.tmp$"
)


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


def _who(holder: dict) -> str:
    """``process 123 on host node-7 (since 22:10:05)``: the holder of a lock, as messages name it."""
    since = time.strftime("%H:%M:%S", time.localtime(holder["since"])) if "since" in holder else "?"
    return f"process {holder.get('pid', '?')} on host {holder.get('host', '?')} (since {since})"


def _is_dead(lock: Path, holder: dict, age: float) -> bool:
    """A lock untouched for ``STALE_LOCK_S``, or one of this host whose holder's ``flock`` is free (its process
    ended, in whatever container; where locks are not kept, a process of this process-id space that exited)."""
    if age > STALE_LOCK_S:
        return True
    if not holder or holder.get("host") != socket.gethostname():
        return False  # being written this instant, or another machine's: its heartbeat tells
    free = nobody_holds(lock)
    if free is not None:
        return free
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
        try:  # made whole, with our flock held, before its name appears
            fd = held_file(directory, LOCK, json.dumps(_identity()).encode(), create_only=True)
        except FileExistsError:
            found = _holder(lock)
            if found is not None and _is_dead(lock, *found):
                say(f"[lightning_seqmem] Token cache entry {directory}: {_who(found[0])} is gone; taking over.")
                _break(lock, found[0])
            elif found is not None and not announced:
                say(f"[lightning_seqmem] Token cache entry {directory} is being written by {_who(found[0])}; waiting.")
                announced = True
            time.sleep(POLL_S)
            continue
        break
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
        os.close(fd)


def writer_prefix(name: str) -> str:
    """``<name>.<host>.<space>-<pid>.``: the start of a temporary file's name that says which process writes it."""
    return f"{name}.{writer_name()}."


@contextmanager
def file_of_this_writer(directory: str | os.PathLike, name: str) -> Iterator[str]:
    """A temporary file of this writer's own in ``directory``, renamed to ``name`` when the block completes and
    removed when it does not (a failed pass leaves nothing behind). Ranks that reach ``setup`` without
    ``prepare_data`` write the same entry at once: each renames its complete file into place. The file carries this
    process's lock while it exists (``cache_dir.held_file``): a cleaner sees a live writer's file as live."""
    tmp = os.path.join(directory, f"{writer_prefix(name)}{secrets.token_hex(6)}.tmp")
    handle = held_file(directory, os.path.basename(tmp))
    try:
        yield tmp
        os.replace(tmp, os.path.join(directory, name))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        os.close(handle)


def writer_is_gone(path: Path, now: float, max_age: float) -> bool:
    """Whether a temporary file belongs to a writer that can no longer finish it: one of this host whose lock on
    the file is free (its process ended; ``cache_dir.nobody_holds``; where locks are not kept, a process of this
    process-id space that has exited), or (any writer, any name) a file nobody has written to for ``max_age`` s."""
    try:
        if now - path.stat().st_mtime > max_age:
            return True
    except FileNotFoundError:  # renamed into place or removed meanwhile
        return False
    match = _TMP_NAME.match(path.name)
    if match is None or match["host"] != socket.gethostname():
        return False  # not a name of ours, or another machine's (its locks may not reach us): only the age tells
    free = nobody_holds(path)
    return free if free is not None else process_is_gone(match["host"], match["space"], int(match["pid"]))
