"""Every rank of a job must train on the same data: compare a digest of each rank's tokenized splits at setup.

Each node reads its own copy of the files when they live on node-local disks (or each node's cache holds its own
entry). Copies that differ — another file, another order, a file cut short — would train silently, the sampler
handing out indices that mean other documents on each node: some read twice, some never. The digest is cheap
(row count, every row's length, the content of a few hundred rows spread over the split), gathered from every
rank once, and a mismatch stops every rank with the same message, naming the node and the files.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Mapping
from typing import Any

__all__ = ["agree_once_per_group", "check_same_data_across_ranks", "split_digest"]

SAMPLED_ROWS = 256  # rows whose content enters the digest, spread evenly over the split
SAMPLED_VALUES = 512  # of each sampled row's lists, the first values (every row's length enters in full)


def split_digest(ds: Any) -> dict[str, Any]:
    """``{"rows", "digest"}`` of a tokenized ``datasets.Dataset``: every list column's per-row lengths and the
    values (the first ``SAMPLED_VALUES`` of each list) of ``SAMPLED_ROWS`` evenly spread rows, first and last
    included, hashed. Equal data, equal digest, whatever the files it is stored in; its cost is one pass over the
    lengths, never over the tokens."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    rows = len(ds)
    h = hashlib.sha256(f"{rows}|{sorted(ds.column_names)}".encode())
    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    order = ds._indices.column(0) if ds._indices is not None else None  # a selected or shuffled view's rows
    picks = pa.array(sorted({int(i) for i in np.linspace(0, rows - 1, min(rows, SAMPLED_ROWS))}), pa.int64())
    sample = table.take(picks if order is None else order.take(picks))
    for name in sorted(ds.column_names):
        column, values = table.column(name), sample.column(name)
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            lengths = pc.list_value_length(column)
            lengths = lengths if order is None else lengths.take(order)
            h.update(np.ascontiguousarray(lengths.to_numpy(zero_copy_only=False), dtype=np.int64).tobytes())
            values = pc.list_slice(values, 0, SAMPLED_VALUES)
        h.update(json.dumps(values.to_pylist(), default=str).encode())
    return {"rows": rows, "digest": h.hexdigest()[:16]}


def _files_of(ds: Any) -> str:
    files = [f.get("filename", "") for f in getattr(ds, "cache_files", None) or []]
    folders = sorted({os.path.dirname(f) for f in files if f})
    return ", ".join(folders) if folders else "data held in memory"


def _node_rank() -> str:
    for key in ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID"):  # torchrun, Lightning's launcher, srun
        if key in os.environ:
            return os.environ[key]
    return "?"


def _facts(dsd: Mapping[str, Any], source: str) -> dict[str, Any]:
    splits = {}
    for split, ds in dsd.items():
        if ds is None or not hasattr(ds, "cache_files") or not hasattr(ds, "__len__"):
            continue  # a stream: read in order from its source, not indexed by a sampler
        splits[split] = {**split_digest(ds), "files": _files_of(ds)}
    return {"host": socket.gethostname(), "node": _node_rank(), "source": source, "splits": splits}


def _who(rank: int, facts: dict[str, Any]) -> str:
    return f"rank {rank} (node {facts['node']}, host {facts['host']})"


def mismatch_message(gathered: list[dict[str, Any]]) -> str | None:
    """The message naming the first rank whose data differs from rank 0's, split by split; ``None`` if all agree."""
    first = gathered[0]
    for rank, facts in enumerate(gathered[1:], start=1):
        for split in sorted(set(first["splits"]) | set(facts["splits"])):
            ours, theirs = first["splits"].get(split), facts["splits"].get(split)
            if ours is not None and theirs is not None and ours["digest"] == theirs["digest"]:
                continue

            def held(f: dict[str, Any], s: dict[str, Any] | None) -> str:
                if s is None:
                    return f"has no {split} split"
                return f"holds {s['rows']:,} rows (digest {s['digest']}) read from {f['source']} (files: {s['files']})"

            return (
                f"The {split} split differs between nodes: {_who(rank, facts)} {held(facts, theirs)}, but "
                f"{_who(0, first)} {held(first, ours)}. Every node must hold the same files, in the same order: copy "
                "them to each node again, or put the data and data.cache_dir on a disk every node reads."
            )
    return None


def check_same_data_across_ranks(dsd: Mapping[str, Any], source: Any = None) -> None:
    """Gather a digest of each rank's tokenized splits (``split_digest``) and refuse data that differs between
    ranks. A collective call: every rank of the job calls it (the DataModule's ``setup``); it does nothing
    without an initialised process group of more than one rank.

    Args:
        dsd: the tokenized splits of this rank (a ``DatasetDict``; streams are skipped).
        source: what the data is called (the DataModule's ``dataset`` argument), named in the message.

    Raises:
        ValueError: on every rank alike, naming the first differing rank's node, host and files, and rank 0's.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    from lightning_seqmem.messages import describe_source

    named = describe_source(source, next(iter(dsd.values()), None)) if source is not None else "the dataset"
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, _facts(dsd, named))
    message = mismatch_message(gathered)
    if message is not None:
        raise ValueError(message)


def agree_once_per_group(sources: Any, checked: Any = None) -> Any:
    """:func:`check_same_data_across_ranks` on each ``(name, tokenized splits)`` of ``sources``, once per process
    group: returns the group now checked (pass it back as ``checked``), ``checked`` as it was without a group of
    several ranks. A collective the first time a group meets it: the DataModule calls it from ``setup``, which every
    rank reaches in ``fit``, even one that read its data before the group existed."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return checked
    group = (dist.get_world_size(), id(dist.group.WORLD))
    if group != checked:
        for name, tokenized in sources:
            check_same_data_across_ranks(tokenized, source=name)
    return group
