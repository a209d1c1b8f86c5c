"""Packing plans kept on disk, so each node plans once and every rank and later run maps the same arrays.

A best-fit plan is a pure function of the document lengths and the packing settings, so the cache key is a hash of
exactly those. At a billion tokens planning costs seconds and a few hundred MB of temporaries per process; with a
plan on disk, ranks after the first (and every later run) read it memory-mapped: the pages are shared through the
page cache and only the parts a process touches become resident.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from lightning_seqmem.batching.packed_rows import PackResult, pack_lengths

# Below this many documents planning takes milliseconds: not worth a file in the cache.
PLAN_CACHE_MIN_DOCUMENTS = 50_000
PLANS, PLAN_META, STAGING_PREFIX = "plans", "plan.json", ".staging-"  # <cache_dir>/PLANS/<key>/PLAN_META
_VERSION = 1  # bump when pack_lengths can give another plan for the same input
_ARRAYS = ("segment_doc", "segment_start", "segment_length", "seg_row_offsets")
_COUNTS = ("documents", "tokens", "tokens_truncated", "tokens_dropped", "documents_split", "empty_documents")


def plan_key(lengths: np.ndarray, max_length: int, packing: str, overflow: str, add_eos: bool = False) -> str:
    """Hash of everything a plan depends on: the lengths themselves (not where they came from) and the settings."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps([_VERSION, int(max_length), packing, overflow, bool(add_eos), len(lengths)]).encode())
    digest.update(np.ascontiguousarray(lengths, dtype=np.int64).data)
    return digest.hexdigest()


def cached_pack_lengths(
    lengths: np.ndarray,
    max_length: int,
    packing: str = "bfd",
    overflow: str = "split",
    cache_dir: str | os.PathLike | None = None,
    add_eos: bool = False,
) -> PackResult:
    """``pack_lengths``, read from ``cache_dir/plans`` when a run with the same lengths and settings wrote it.

    The arrays come back memory-mapped read-only. A missing or unreadable plan is planned again and written
    atomically (a temporary directory renamed into place), so ranks racing on one node never read half a plan.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if cache_dir is None or lengths.size < PLAN_CACHE_MIN_DOCUMENTS:
        return pack_lengths(lengths, max_length, packing, overflow, add_eos=add_eos)
    directory = Path(cache_dir) / PLANS / plan_key(lengths, max_length, packing, overflow, add_eos)
    loaded = _load(directory)
    if loaded is not None:
        return loaded
    plan = pack_lengths(lengths, max_length, packing, overflow, add_eos=add_eos)
    try:
        _save(plan, directory)
    except OSError:  # a read-only or full cache: the plan in memory is still right
        pass
    return plan


def _load(directory: Path) -> PackResult | None:
    try:
        with open(directory / PLAN_META) as f:
            meta = json.load(f)
        arrays = {name: np.load(directory / f"{name}.npy", mmap_mode="r") for name in _ARRAYS}
    except (OSError, ValueError):
        return None
    return PackResult(
        max_length=meta["max_length"], packing=meta["packing"], **arrays, **{name: meta[name] for name in _COUNTS}
    )


def _save(plan: PackResult, directory: Path) -> None:
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=directory.parent))
    try:
        for name in _ARRAYS:
            np.save(staging / f"{name}.npy", np.ascontiguousarray(getattr(plan, name), dtype=np.int64))
        meta = {"max_length": plan.max_length, "packing": plan.packing, **{n: int(getattr(plan, n)) for n in _COUNTS}}
        with open(staging / PLAN_META, "w") as f:
            json.dump(meta, f)
        os.rename(staging, directory)  # fails when another rank got there first with the same plan
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone after the rename; else a half-written or spare copy
