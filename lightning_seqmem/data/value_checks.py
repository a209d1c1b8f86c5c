"""Pre-tokenized token values checked once per dataset version (every id in the vocabulary), remembered under the
cache directory with the largest id found, so later runs and every rank skip reading every token again."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_seqmem.data.arrow_stream import system_memory_pool
from lightning_seqmem.data.cache_dir import default_cache_dir

if TYPE_CHECKING:
    from lightning_seqmem.data.columns import LargestTokenId

CHECKED = "checked"
"""Folder of the markers under the cache root (``<root>/checked/<key>``; ``seqmem-cache`` lists it)."""


def check_values_once(
    ds, kind: str, columns: tuple[str, ...], split: str, vocab_size: int | None = None, cache_dir: Any = None
) -> LargestTokenId | None:
    """Check pre-tokenized token values (``columns.check_token_values`` on ``columns``) once per dataset version,
    then remember it by the data's fingerprint and ``kind`` (the pre-tokenized kind's name), so later runs and every
    rank skip it: the check reads every token, and on a memory-mapped billion-token file that touches every page
    (4 GB of resident memory) on each run. The marker keeps the largest id the check found, which a model's
    embedding table must hold (``training.checks.check_vocab_fits``): later runs know it without reading a token.

    Returns:
        The largest id of the split (and its column; ``None``: no id), found now or remembered.
    """
    from lightning_seqmem.data.columns import LargestTokenId, check_token_values
    from lightning_seqmem.data.tokens import dataset_indices

    fingerprint = getattr(ds, "_fingerprint", None)
    if fingerprint is None or not getattr(ds, "cache_files", None):  # in memory: no stable version to remember
        return check_token_values(ds, columns, split, vocab_size)
    key = hashlib.sha256(
        json.dumps(["tokens-v1", "values-checked", fingerprint, kind, vocab_size]).encode()
    ).hexdigest()
    marker = Path(cache_dir or default_cache_dir()) / CHECKED / key
    remembered = _read_marker(marker)
    if remembered is not None:
        largest, column = remembered
        return None if column is None else LargestTokenId(largest, split, column)
    files = [f["filename"] for f in ds.cache_files]
    found = _streamed_largest(files, columns, vocab_size, len(ds.data), dataset_indices(ds))
    if found is None:  # not shown clean, or not all of it read: the exact check names a bad row (raises: no marker)
        largest = check_token_values(ds, columns, split, vocab_size)
    else:
        largest = None if found[1] is None else LargestTokenId(found[0], split, found[1])
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(
            json.dumps({"largest": largest.id if largest else None, "column": getattr(largest, "column", None)})
        )
    except OSError:  # an unwritable cache: the check runs again next time
        pass
    return largest


def _read_marker(marker: Path) -> tuple[int | None, str | None] | None:
    """``(largest id, its column)`` an earlier run remembered; ``None``: no marker, or one written before markers
    kept the largest id (empty: the data are read once more)."""
    try:
        saved = json.loads(marker.read_text())
        return saved["largest"], saved["column"]
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _streamed_largest(
    files: list[str], columns: tuple[str, ...], vocab_size: int | None, table_rows: int, indices
) -> tuple[int, str | None] | None:
    """``(largest id, its column)`` (``(-1, None)``: no id) if every id in the Arrow files is an integer in
    ``[0, vocab_size)`` (labels may be ``IGNORE_INDEX``), else ``None``.

    The files are read record batch by record batch, not memory-mapped, so resident memory stays one batch
    however large the data (and with ``indices``, one max per row: the largest id is that of the rows the dataset
    selects). ``None`` means "not shown clean" (a bad id, a non-integer column, a file that is not an Arrow stream,
    or files whose rows are not the dataset's table, e.g. a contiguous ``select``): the caller then runs the exact
    check, which names the row.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from lightning_seqmem.batch import IGNORE_INDEX  # here, not above: seqmem-cache reads CHECKED without torch
    from lightning_seqmem.data.columns import row_maxima

    largest, where, rows = -1, None, 0
    per_row: dict[str, list] = {}  # with indices: per column, each row's largest id
    try:
        for path in files:
            with system_memory_pool(), pa.OSFile(path) as source:
                for batch in pa.ipc.open_stream(source):
                    if {"input_ids", "labels"} <= set(batch.schema.names) and pc.all(
                        pc.equal(*(pc.list_value_length(batch.column(c)) for c in ("input_ids", "labels")))
                    ).as_py() not in (True, None):
                        return None  # a row whose labels are not one per token: the exact check names it
                    rows += batch.num_rows if set(columns) & set(batch.schema.names) else 0
                    for column in columns:
                        if column not in batch.schema.names:
                            continue
                        values = pc.list_flatten(batch.column(column))
                        if not pa.types.is_integer(values.type):
                            return None
                        if indices is not None:
                            offsets = batch.column(column).offsets.to_numpy().astype(np.int64)
                            flat = batch.column(column).values.to_numpy(zero_copy_only=False)
                            per_row.setdefault(column, []).append(row_maxima(flat, offsets[:-1], np.diff(offsets)))
                        if column == "labels":
                            values = pc.filter(values, pc.not_equal(values, IGNORE_INDEX))
                        low, high = pc.min_max(values).values()
                        if not low.is_valid:
                            continue
                        if low.as_py() < 0 or (vocab_size is not None and high.as_py() >= vocab_size):
                            return None
                        if indices is None and high.as_py() > largest:
                            largest, where = high.as_py(), column
    except (OSError, pa.ArrowInvalid):
        return None
    if rows != table_rows:
        return None
    for column, maxima in per_row.items():
        high = int(np.concatenate(maxima)[indices].max(initial=-1))
        if high > largest:
            largest, where = high, column
    return largest, where
