"""The column names of preference pairs, and the one check of pre-tokenized ids against a vocabulary (which kind
of data a dataset holds is ``lightning_seqmem.kinds.detect``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PREFERENCE_TEXT = ("prompt", "chosen", "rejected")
"""Text columns of preference pairs (TRL's names); the prompt is shared by both sequences of a pair."""

PREFERENCE_IDS = ("prompt_ids", "chosen_ids", "rejected_ids")
"""Token columns of preference pairs (TRL's names)."""


@dataclass(frozen=True)
class LargestTokenId:
    """The largest token id of pre-tokenized data and where it is: a model needs ``id + 1`` embedding rows.

    Attributes:
        id: the largest id of any id column (an ignored label, -100, is no id).
        split: the split holding it.
        column: the column holding it (``input_ids``, ``labels``, ``chosen_ids``, ...).
    """

    id: int
    split: str
    column: str


def largest_of(found: list[LargestTokenId | None]) -> LargestTokenId | None:
    """The largest of several splits' answers; ``None`` when none holds an id."""
    return max((f for f in found if f is not None), key=lambda f: f.id, default=None)


def check_token_values(
    ds, columns: tuple[str, ...], split: str, vocab_size: int | None = None
) -> LargestTokenId | None:
    """Pre-tokenized data: every token id of ``columns`` an integer in ``[0, vocab_size)`` (labels may also be
    -100, and are one per token); :func:`check_token_table` on ``ds``'s table, rows named as ``ds`` numbers them.

    Returns:
        The largest id of the rows ``ds`` selects (``None``: no id).
    """
    from lightning_seqmem.data.tokens import dataset_indices

    return check_token_table(ds.data, columns, split, vocab_size, dataset_indices(ds))


def check_token_table(
    table, columns: tuple[str, ...], split: str, vocab_size: int | None = None, indices=None, first_row: int = 0
) -> LargestTokenId | None:
    """Token ids of ``columns`` (those ``table`` has) checked: lists of integers in ``[0, vocab_size)`` (labels
    may also be -100), ``labels`` one per ``input_ids`` token. The one check of pre-tokenized values, for a whole
    split (map-style) and for a stream's rows as they are read.

    Vectorised: a min/max per Arrow chunk, and only where that fails, the offending row (``searchsorted``). The
    largest id comes from the same max where the chunk holds exactly its rows' tokens; a sliced table, or rows
    through ``indices``, take the max of each row (``row_maxima``), so tokens of rows not selected do not count.

    Args:
        indices: the rows of ``table`` a dataset selects (``tokens.dataset_indices``); ``None``: all, in order.
        first_row: the number of the table's first row in messages (a stream's rows are checked a few at a time).

    Returns:
        The largest id of the rows checked (``None``: no id), for the model's embedding check.

    Raises:
        ValueError: a non-integer column, an out-of-range id, or labels and ids of different lengths; the
            message names the split, column and row.
    """
    import pyarrow as pa

    from lightning_seqmem.batch import IGNORE_INDEX
    from lightning_seqmem.data.tokens import view_of_arrow

    names = table.column_names
    largest = None
    for column in columns:
        if column not in names:
            continue
        arrow = table.column(column)
        value_type = getattr(arrow.type, "value_type", None)
        if value_type is None or not pa.types.is_integer(value_type):
            raise ValueError(
                f"Split {split!r}, column {column!r} holds {value_type or arrow.type} values: token ids must be lists "
                "of integers (row 0 onward). "
                f"Cast it (dataset.cast_column({column!r}, datasets.List(datasets.Value('int32')))) or tokenize again."
            )
        view = view_of_arrow(arrow)  # table rows, in order: starts are sorted
        highs = []  # per chunk, its largest value (-1: none)
        for chunk, base in zip(view.chunks, view.chunk_base[:-1].tolist()):
            if not chunk.size:
                highs.append(-1)
                continue
            lo, hi = int(chunk.min()), int(chunk.max())
            highs.append(hi)
            if lo >= 0 and (vocab_size is None or hi < vocab_size):
                continue
            bad = chunk < 0
            if column == "labels":
                bad &= chunk != IGNORE_INDEX  # the ignored label is the one negative value allowed
            if vocab_size is not None:
                bad |= chunk >= vocab_size
            rows = np.unique(np.searchsorted(view.starts, base + np.flatnonzero(bad), side="right") - 1)
            if indices is not None:  # table rows to the dataset's rows (rows it does not select are not ours)
                rows = np.flatnonzero(np.isin(indices, rows))
            if rows.size:
                limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise ValueError(
                    f"Row {first_row + int(rows[0])} of split {split!r}, column {column!r} holds a token id "
                    f"outside {limit}"
                    f"{' (or -100)' if column == 'labels' else ''} ({rows.size} such rows). Token ids must index the "
                    "tokenizer's vocabulary: re-tokenize with the tokenizer you pass, or pass the one used."
                )
        high = _largest_id(view, arrow, highs, indices)
        if high >= 0 and (largest is None or high > largest.id):
            largest = LargestTokenId(high, split, column)
    if "labels" in names and "input_ids" in names:
        _check_one_label_per_token(table, split, indices, first_row)
    return largest


def row_maxima(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``[rows]`` the largest value of each row ``values[starts[i] : starts[i] + lengths[i]]`` (rows in order and
    back to back, as an Arrow list array's offsets lay them out); -1 for an empty row."""
    out = np.full(len(starts), -1, np.int64)
    full = lengths > 0
    if full.any():
        end = int(starts[full][-1] + lengths[full][-1])
        out[full] = np.maximum.reduceat(values[:end], starts[full])
    return out


def _largest_id(view, arrow, highs: list[int], indices) -> int:
    """The largest id of a column's rows (those ``indices`` select): its chunks' maxima ``highs`` where each chunk
    holds exactly its rows' tokens, else each row's max (``row_maxima``), so that the tokens of rows a sliced table
    or ``indices`` leave out do not count. -1: no id."""
    import pyarrow as pa

    counts = [len(c) for c in (arrow.chunks if isinstance(arrow, pa.ChunkedArray) else [arrow])]
    if not counts:
        return -1
    bounds = np.concatenate([[0], np.cumsum(counts)])
    rows = [slice(bounds[k], bounds[k + 1]) for k in range(len(counts))]
    ends = view.starts + view.lengths
    exact = indices is None and all(
        not chunk.size or (r.stop > r.start and view.starts[r.start] == base and ends[r.stop - 1] == end)
        for chunk, r, base, end in zip(view.chunks, rows, view.chunk_base[:-1], view.chunk_base[1:])
    )
    if exact:
        return max(highs, default=-1)
    maxima = np.concatenate(
        [
            row_maxima(c, view.starts[r] - base, view.lengths[r])
            for c, r, base in zip(view.chunks, rows, view.chunk_base)
        ]
    )
    return int((maxima if indices is None else maxima[indices]).max(initial=-1))


def _check_one_label_per_token(table, split: str, indices, first_row: int) -> None:
    import pyarrow.compute as pc

    ids, labels = (
        pc.list_value_length(table.column(c)).to_numpy(zero_copy_only=False) for c in ("input_ids", "labels")
    )
    ids, labels = (ids, labels) if indices is None else (ids[indices], labels[indices])
    wrong = np.flatnonzero((ids != labels) & ~np.isnan(labels.astype(np.float64)))
    if wrong.size:
        row = int(wrong[0])
        raise ValueError(
            f"Row {first_row + row} of split {split!r}: {int(ids[row])} input_ids but {int(labels[row])} labels; "
            "they must have one label per token."
        )


def id_function(columns: tuple[str, ...], vocab_size: int | None = None):
    """The batched map function of pre-tokenized rows (a stream's): their ``columns`` checked by
    :func:`check_token_table` (the map-style check, its messages), passed on as lists, with their ``length``
    (``input_ids`` and ``labels`` count once)."""

    def fn(batch, indices, split):
        import pyarrow as pa

        have = [c for c in columns if any(v is not None for v in batch.get(c) or ())]
        try:
            table = pa.table({c: _id_array(batch[c]) for c in have})
        except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
            raise ValueError(
                f"Rows {list(indices)} of split {split!r}: token ids must be lists of integers ({error}). "
                "Filter the data, or tokenize again."
            ) from None
        check_token_table(table, tuple(have), split, vocab_size, first_row=int(indices[0]) if len(indices) else 0)
        out = {c: [list(v) for v in batch[c]] for c in have}
        counted = [c for c in have if c != "labels"]
        out["length"] = [sum(len(out[c][i]) for c in counted) for i in range(len(indices))]
        return out

    return fn


def _id_array(values: list):
    """Rows of ids as an Arrow list array: int64 where they are integers (an empty row too), else as inferred,
    so the check names what they hold."""
    import pyarrow as pa

    try:
        return pa.array(values, type=pa.list_(pa.int64()))
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
        return pa.array(values)
