"""Read token segments from the file behind a memory-mapped Arrow buffer with ``pread``, not through the map.

Serving a batch touches a few documents scattered over the token file. Through the memory map, each touch maps the
page-cache folio around it into the process (on recent Linux kernels a large folio: up to 2 MB for a few KB of
tokens), so resident memory climbs by megabytes per document and, over an epoch, to the size of the file, on every
rank and DataLoader worker. ``pread`` copies the tokens a row needs and maps nothing: resident memory stays the plan
arrays plus the batch. Bulk passes (materialising every packed row) still read through the map, which is faster
when everything is read anyway.
"""

from __future__ import annotations

import bisect
import os
import sys
from typing import Any

import numpy as np

Location = tuple[str, int]  # (path, byte offset of the array's first byte in that file)


def _file_mappings() -> list[tuple[int, int, int, str]]:
    """``(start, end, file offset, path)`` of this process's file-backed mappings, sorted by start (Linux)."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) < 6 or parts[4] == "0" or not parts[5].startswith("/"):
                    continue
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.append((start, end, int(parts[2], 16), parts[5].rstrip("\n")))
    except OSError:
        return []
    out.sort()
    return out


def file_locations(arrays: list[np.ndarray]) -> list[Location | None]:
    """Where each array lies in the file it is memory-mapped from, or ``None`` (in memory, or not Linux)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "preadv"):
        return [None] * len(arrays)
    maps = _file_mappings()
    starts = [m[0] for m in maps]
    out: list[Location | None] = []
    for a in arrays:
        address = a.__array_interface__["data"][0]
        k = bisect.bisect_right(starts, address) - 1
        if (
            a.size == 0
            or not a.flags.c_contiguous
            or k < 0
            or address + a.nbytes > maps[k][1]
            or not os.path.isfile(maps[k][3])
        ):
            out.append(None)
            continue
        start, _, offset, path = maps[k]
        out.append((path, offset + address - start))
    return out


class SegmentReader:
    """``pread`` of element ranges of memory-mapped arrays, by their files. Files are opened lazily per process
    (a forked DataLoader worker opens its own), and never pickled."""

    def __init__(self, locations: list[Location | None], itemsize: int) -> None:
        self.locations, self.itemsize = locations, itemsize
        self._fds: dict[str, int] = {}
        self._pid = os.getpid()

    def covers(self, chunks: np.ndarray) -> bool:
        return all(self.locations[c] is not None for c in np.unique(chunks).tolist())

    def _fd(self, path: str) -> int:
        if self._pid != os.getpid():  # forked: the parent's descriptors share its file positions; open our own
            self._fds, self._pid = {}, os.getpid()
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def read(self, out: np.ndarray, chunks: list[int], local: list[int], lengths: list[int]) -> np.ndarray:
        """Fill ``out`` with elements ``local[i] : local[i] + lengths[i]`` of chunk ``chunks[i]``, back to back."""
        view = memoryview(out).cast("B")
        item, pos = self.itemsize, 0
        for c, first, n in zip(chunks, local, lengths):
            if n == 0:
                continue
            path, base = self.locations[c]
            want, done = n * item, 0
            while done < want:  # pread may return short
                got = os.preadv(self._fd(path), [view[pos + done : pos + want]], base + first * item + done)
                if got <= 0:
                    raise OSError(f"{path} is shorter than its memory-mapped data (was it changed on disk?)")
                done += got
            pos += want
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {"locations": self.locations, "itemsize": self.itemsize}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["locations"], state["itemsize"])

    def __del__(self) -> None:
        if getattr(self, "_pid", None) == os.getpid():
            for fd in self._fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
