"""Where lightning_seqmem keeps what it builds once and reuses: the built-in corpus and tokenizer, tokenized splits,
packing plans. One root for all of them, so ``seqmem-cache`` lists and removes them in one place.

The root may be a disk that many machines share (NFS, Lustre), and several containers of one machine may share a
host name without sharing process ids. So a writer is named by its host, a key of the process-id space it lives in
(the machine's boot and the pid namespace) and its process id: a writer's process can be asked whether it is alive
only from the same space. Whatever a writer builds goes first to a name no other writer can draw (``mkstemp``,
``mkdtemp``) and is renamed into place whole.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["build_folder", "default_cache_dir", "pid_space", "process_is_gone", "writer_name"]


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
