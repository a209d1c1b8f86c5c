"""Pre-tokenized token values checked once per dataset version (every id in the vocabulary), remembered under the
cache directory so later runs and every rank skip reading every token again."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from lightning_seqmem.data.arrow_stream import system_memory_pool
from lightning_seqmem.data.cache_dir import default_cache_dir

CHECKED = "checked"
"""Folder of the markers under the cache root (``<root>/checked/<key>``; ``seqmem-cache`` lists it)."""


def check_values_once(
    ds, kind: str, columns: tuple[str, ...], split: str, vocab_size: int | None = None, cache_dir: Any = None
) -> bool:
    """Check pre-tokenized token values (``columns.check_token_values`` on ``columns``) once per dataset version,
    then remember it by the data's fingerprint and ``kind`` (the pre-tokenized kind's name), so later runs and every
    rank skip it: the check reads every token, and on a memory-mapped billion-token file that touches every page
    (4 GB of resident memory) on each run.

    Returns:
        Whether the check ran (``False``: an earlier run checked this data against the same vocabulary).
    """
    from lightning_seqmem.data.columns import check_token_values

    fingerprint = getattr(ds, "_fingerprint", None)
    if fingerprint is None or not getattr(ds, "cache_files", None):  # in memory: no stable version to remember
        check_token_values(ds, columns, split, vocab_size)
        return True
    key = hashlib.sha256(
        json.dumps(["tokens-v1", "values-checked", fingerprint, kind, vocab_size]).encode()
    ).hexdigest()
    marker = Path(cache_dir or default_cache_dir()) / CHECKED / key
    if marker.exists():
        return False
    if not _streamed_values_ok([f["filename"] for f in ds.cache_files], columns, vocab_size):
        check_token_values(ds, columns, split, vocab_size)  # the exact check names the bad row; raises: no marker
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:  # an unwritable cache: the check runs again next time
        pass
    return True


def _streamed_values_ok(files: list[str], columns: tuple[str, ...], vocab_size: int | None) -> bool:
    """Whether every id in the Arrow files is an integer in ``[0, vocab_size)`` (labels may be ``IGNORE_INDEX``).

    The files are read record batch by record batch, not memory-mapped, so resident memory stays one batch
    however large the data. ``False`` means "not shown clean" (a bad id, a non-integer column, or a file that is
    not an Arrow stream): the caller then runs the exact check, which names the row.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    from lightning_seqmem.batch import IGNORE_INDEX  # here, not above: seqmem-cache reads CHECKED without torch

    try:
        for path in files:
            with system_memory_pool(), pa.OSFile(path) as source:
                for batch in pa.ipc.open_stream(source):
                    if {"input_ids", "labels"} <= set(batch.schema.names) and pc.all(
                        pc.equal(*(pc.list_value_length(batch.column(c)) for c in ("input_ids", "labels")))
                    ).as_py() not in (True, None):
                        return False  # a row whose labels are not one per token: the exact check names it
                    for column in columns:
                        if column not in batch.schema.names:
                            continue
                        values = pc.list_flatten(batch.column(column))
                        if not pa.types.is_integer(values.type):
                            return False
                        if column == "labels":
                            values = pc.filter(values, pc.not_equal(values, IGNORE_INDEX))
                        low, high = pc.min_max(values).values()
                        if low.is_valid and (
                            low.as_py() < 0 or (vocab_size is not None and high.as_py() >= vocab_size)
                        ):
                            return False
    except (OSError, pa.ArrowInvalid):
        return False
    return True
