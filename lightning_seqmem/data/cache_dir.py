"""Where lightning_seqmem keeps what it builds once and reuses: the built-in corpus and tokenizer, tokenized splits,
packing plans. One root for all of them, so ``seqmem-cache`` lists and removes them in one place.

The root may be a disk that many machines share (NFS, Lustre), and several containers of one machine may share a
host name and even process ids. So whether a writer is alive is not read from its name: every file a writer is
still writing carries a lock that its process holds (``flock``, taken before the file gets its visible name and
released by the kernel when the process ends, whatever its pid namespace), and another process of the machine
asks for that lock. The name (host, a key of the process-id space, pid) only tells whose file it is, and where
the file system keeps no locks, which writers can be asked by process id. Whatever a writer builds goes first to
a name no other writer can draw (``mkstemp``, ``mkdtemp``) and is renamed into place whole.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

__all__ = [
    "build_folder",
    "default_cache_dir",
    "held_file",
    "nobody_holds",
    "pid_space",
    "process_is_gone",
    "writer_name",
]


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lightning_seqmem``, else ``~/.cache/lightning_seqmem``."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "lightning_seqmem"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]": the same inode on every machine's root space
    except OSError:
        return ""


def pid_space() -> str:
    """12 hex digits naming the space this process's id means something in: the boot of this machine (shared by
    its containers) and its pid namespace (not shared by them). Empty pieces where the system does not say."""
    boot = _read("/proc/sys/kernel/random/boot_id")
    return hashlib.sha256(f"{boot}|{_pid_namespace()}".encode()).hexdigest()[:12]


def writer_name() -> str:
    """``<host>.<pid space>-<pid>``: who writes a temporary file, in the file's name."""
    return f"{socket.gethostname()}.{pid_space()}-{os.getpid()}"


def process_is_gone(host: str, space: str, pid: int) -> bool:
    """Whether the writer named ``host``, ``space``, ``pid`` has certainly exited: only a process of this host and
    this process-id space can be asked; any other may be alive (its file's age is the only sign, the caller's)."""
    if host != socket.gethostname() or space != pid_space():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: alive, another user's
        pass
    return False


def held_file(directory: str | os.PathLike, name: str, content: bytes = b"", create_only: bool = False) -> int:
    """Create ``directory/name`` holding ``content``, with this process's lock on it already held when the name
    appears (the file is made and locked under a hidden name first); the open descriptor, which keeps the lock
    until it is closed. ``create_only``: ``FileExistsError`` where ``name`` exists (an atomic link, on NFS too)."""
    handle, pending = tempfile.mkstemp(prefix=".pending-", suffix=".tmp", dir=directory)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a file system without locks: the name and the file's age judge
            pass
        os.write(handle, content)
        target = os.path.join(directory, name)
        if create_only:
            os.link(pending, target)
        else:
            os.rename(pending, target)
    except BaseException:
        os.close(handle)
        raise
    finally:
        if create_only or os.path.exists(pending):
            with suppress(OSError):
                os.unlink(pending)
    return handle


def nobody_holds(path: str | os.PathLike) -> bool | None:
    """Whether no process holds the writer's lock on ``path`` (``held_file``): ``True`` once its writer has ended,
    ``False`` while it writes (or the file is gone), ``None`` where the file system cannot tell. Locks are seen
    across containers of one machine; across machines only where the file system shares them, so callers trust a
    ``True`` for files of their own host only."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    finally:
        os.close(fd)  # our probe's lock goes with it
    return True


@contextmanager
def build_folder(path: str | os.PathLike) -> Iterator[Path]:
    """A fresh folder of this writer's own beside ``path``, renamed to ``path`` when the block completes.

    Writers that build the same folder at once (nodes on a shared disk, ranks, containers with one host name and
    one process id) each fill their own; the first rename wins and the others' folders are removed, their content
    being the same. A failed block leaves nothing behind.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{path.name}.{writer_name()}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        try:
            os.replace(tmp, path)  # onto a missing or empty folder only: an existing build is kept
        except OSError:
            if not path.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
