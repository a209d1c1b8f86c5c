"""Where the documents come from: resolve a dataset argument into a ``DatasetDict``, carve out validation.

Accepted datasets: ``"builtin"`` (the standard-library corpus), ``"builtin_chat"`` (the same as conversations),
``"builtin_preference"`` (its documents as preference pairs, ``data.preference_corpus``), a
``datasets.Dataset``/``DatasetDict``, a ``pandas.DataFrame`` (its columns), a directory saved with ``save_to_disk``,
local ``.json``/``.jsonl``/``.parquet``/``.txt``/``.csv`` files (a path,
a glob or a list), a hub name (loaded with ``datasets.load_dataset``; only when the user asks for it), or the
data itself: a list of strings (documents), of dicts (rows) or of conversations (lists of ``{"role", "content"}``
dicts, which become a ``messages`` column).

A list is files when every item is an existing file or directory or a glob that matches files; otherwise it is
documents (strings) or rows (dicts). A list that mixes existing files with strings that are not, or whose items
all look like file names (no whitespace, a known extension) that do not exist, is an error, not documents.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lightning_seqmem.data.local_files import load_path_or_name, looks_like_file_name, matches
from lightning_seqmem.data.preference_corpus import BUILTIN_PREFERENCE
from lightning_seqmem.messages import short_repr

BUILTIN_CHAT = "builtin_chat"
"""``dataset="builtin_chat"``: the built-in corpus as multi-turn conversations (``data.chat_corpus``)."""


def _is_conversation(item: Any) -> bool:
    """A list of dicts (turns): one conversation of a list of conversations."""
    return (
        isinstance(item, Sequence)
        and not isinstance(item, (str, bytes, os.PathLike))
        and all(isinstance(turn, Mapping) for turn in item)
    )


def _value_kind(value: Any) -> str | None:
    """What a cell holds, in a user's words; ``None`` for a missing value (it fits any column)."""
    if value is None:
        return None
    if isinstance(value, str):
        return "text"
    if isinstance(value, Mapping):
        return "a dict"
    if isinstance(value, numbers.Number):  # numpy's scalars too (a DataFrame's cells)
        return "a number"
    if _is_conversation(value) and len(value) > 0:
        return "turns (a list of {'role', 'content'} dicts)"
    if isinstance(value, Sequence) or hasattr(value, "__array__"):
        return "a list"
    return type(value).__name__


def mixed_rows(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """The first row whose value in some column is of another kind than the column's first value (text where
    row 0 has turns, a list where it has a number), named with its row and column; ``None`` when every column holds
    one kind."""
    first: dict[str, tuple[int, str]] = {}
    for i, row in enumerate(rows):
        for column, value in row.items():
            kind = _value_kind(value)
            if kind is None:
                continue
            seen = first.setdefault(column, (i, kind))
            if seen[1] != kind:
                return (
                    f"row {i}, column {column!r} holds {kind} ({short_repr(value)}) where row {seen[0]} holds "
                    f"{seen[1]}; a column holds one kind in every row (preference pairs: all text, or all turns)"
                )
    return None


def _dataset_from_items(items: Sequence[Any]):
    """A list given as ``dataset=``: files (every item names existing files), else documents or rows.

    Raises:
        ValueError: an empty list; a list mixing existing files with strings that are not; file names none of
            which exist; items that are neither strings nor dicts, or both.
    """
    import datasets

    items = list(items)
    if not items:
        raise ValueError("dataset is an empty list: pass documents (strings), rows (dicts) or file paths.")
    if all(_is_conversation(x) for x in items):  # conversations: each a list of {"role", "content"} turns
        items = [{"messages": [dict(turn) for turn in x]} for x in items]
    if all(isinstance(x, Mapping) for x in items):
        rows = [dict(x) for x in items]
        try:
            return datasets.DatasetDict(train=datasets.Dataset.from_list(rows))
        except Exception as err:  # ragged or mixed-type rows
            raise ValueError(
                f"dataset is a list of {len(rows)} dicts that do not form a table: "
                f"{mixed_rows(rows) or f'{type(err).__name__}: {short_repr(str(err))}'}. Give every row the same keys "
                "with values of one kind."
            ) from err
    if not all(isinstance(x, (str, os.PathLike)) for x in items):
        kinds = sorted({type(x).__name__ for x in items})
        raise TypeError(
            f"dataset is a list of {', '.join(kinds)}: pass strings (documents or file paths), "
            "dicts (rows) or conversations (lists of {'role', 'content'} dicts), not a mix."
        )
    items = [os.fspath(x) for x in items]
    missing = [x for x in items if not matches(x)]
    if not missing:
        return None  # every item names files: the caller loads them
    if len(missing) < len(items):
        raise FileNotFoundError(
            f"dataset is a list of {len(items)} strings: {len(items) - len(missing)} of them name existing files, "
            f"{len(missing)} do not (first: {short_repr(missing[0])}). Fix the paths, or pass documents only."
        )
    if all(looks_like_file_name(x) for x in items):
        raise FileNotFoundError(
            f"dataset is a list of file names, none of which exists (first: {short_repr(items[0])}). Check the "
            "paths (relative to the directory you run from); documents are taken as documents only when they are "
            "not all bare file names."
        )
    return datasets.DatasetDict(train=datasets.Dataset.from_dict({"text": items}))


def _is_data_frame(dataset: Any) -> bool:
    """Whether ``dataset`` is a ``pandas.DataFrame`` (pandas imported only when the user passed one)."""
    return type(dataset).__name__ == "DataFrame" and type(dataset).__module__.startswith("pandas")


def load_text_dataset(dataset: Any = "builtin"):
    """Resolve ``dataset`` to a ``DatasetDict`` with (at least) a non-empty ``train`` split.

    A list of strings is documents (a ``text`` column) unless every item names existing files; a list of dicts
    is rows (see the module docstring for the rule).

    Raises:
        FileNotFoundError: a path that does not exist and is not a dataset name.
        ValueError: an empty dataset or file, a malformed file (the message names the file and line), or a file
            type we cannot read.
    """
    import datasets

    if isinstance(dataset, str) and dataset == "builtin":
        from lightning_seqmem.data.corpus import load_builtin_corpus

        dsd = load_builtin_corpus()
    elif isinstance(dataset, str) and dataset == BUILTIN_CHAT:
        from lightning_seqmem.data.chat_corpus import load_builtin_chat_corpus

        dsd = datasets.DatasetDict(
            {split: datasets.Dataset.from_list(rows) for split, rows in load_builtin_chat_corpus().items()}
        )
    elif isinstance(dataset, str) and dataset == BUILTIN_PREFERENCE:
        from lightning_seqmem.data.preference_corpus import load_builtin_preference_corpus

        dsd = load_builtin_preference_corpus()
    elif isinstance(dataset, datasets.DatasetDict):
        dsd = dataset
    elif isinstance(dataset, datasets.Dataset):
        dsd = datasets.DatasetDict(train=dataset)
    elif isinstance(dataset, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        raise TypeError(
            "A stream (datasets.IterableDataset) is not read here: SeqMemDataModule packs it on the fly "
            "(batching=Pack()). For the split pipeline and seqmem-plan, pass a map-style dataset "
            "(load_dataset(..., streaming=False))."
        )
    elif dataset is None:
        raise ValueError(
            "No dataset given (dataset=None): pass 'builtin', a path, a glob, a list of documents, "
            "a datasets.Dataset or a hub name (seqmem-train: data.dataset=<path or name>)."
        )
    elif _is_data_frame(dataset):
        try:
            dsd = datasets.DatasetDict(train=datasets.Dataset.from_pandas(dataset, preserve_index=False))
        except Exception as err:  # a column of mixed kinds (object dtype)
            mixed = mixed_rows(dataset.to_dict("records"))
            if mixed is None:
                raise
            raise ValueError(f"dataset (a DataFrame) does not form a table: {mixed}.") from err
    elif isinstance(dataset, (str, os.PathLike)):
        dsd = load_path_or_name(dataset)
    elif isinstance(dataset, Sequence):  # list, tuple, OmegaConf ListConfig
        dsd = _dataset_from_items(dataset)
        if dsd is None:
            dsd = load_path_or_name([os.fspath(x) for x in dataset])
    else:
        raise TypeError(
            "dataset must be 'builtin', a datasets.Dataset/DatasetDict, a pandas.DataFrame, a path, a list of files, "
            f"documents or rows, or a hub name; got {type(dataset).__name__}."
        )
    if "train" not in dsd:
        raise ValueError(
            f"The dataset has splits {short_repr(sorted(dsd))}, but no 'train' split; rename one to 'train'."
        )
    if len(dsd["train"]) == 0:
        raise ValueError("The dataset's train split is empty: there is nothing to train on. Check the path or filter.")
    return dsd


def open_stream(dataset: Any, shards: int = 8):
    """``dataset`` as a ``datasets`` stream (``SeqMemDataModule(streaming=True)``).

    Local files and hub names are read lazily (``load_dataset(..., streaming=True)``: nothing is converted to Arrow
    or downloaded ahead, so training starts at once on data of any size), after the same checks as map-style files;
    anything else (the built-in corpora, a ``Dataset``, a ``save_to_disk`` folder, a list of documents or rows) is
    loaded as usual and served as a stream of up to ``shards`` shards, so loader workers and ranks can share it.
    """
    import datasets

    if isinstance(dataset, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        return dataset
    builtin = isinstance(dataset, str) and dataset in ("builtin", BUILTIN_CHAT, BUILTIN_PREFERENCE)
    if isinstance(dataset, (str, os.PathLike)) and not builtin:
        loaded = load_path_or_name(dataset, streaming=True)
    elif isinstance(dataset, Sequence) and not isinstance(dataset, str):
        loaded = _dataset_from_items(dataset)  # documents or rows; None: files
        if loaded is None:
            loaded = load_path_or_name([os.fspath(x) for x in dataset], streaming=True)
    else:
        loaded = load_text_dataset(dataset)
    if "train" not in loaded:
        raise ValueError(
            f"The dataset has splits {short_repr(sorted(loaded))}, but no 'train' split; rename one to 'train'."
        )
    if isinstance(loaded, datasets.IterableDatasetDict):
        return loaded
    return datasets.IterableDatasetDict(
        {split: ds.to_iterable_dataset(num_shards=max(1, min(shards, len(ds)))) for split, ds in loaded.items()}
    )


def ensure_validation_split(dsd, validation_fraction: float = 0.05, seed: int = 42):
    """Give a ``DatasetDict`` without a ``validation`` split one: its ``test`` split, or a seeded slice of train."""
    import datasets

    if "validation" in dsd:
        return dsd
    if "test" in dsd:
        return datasets.DatasetDict(train=dsd["train"], validation=dsd["test"])
    if len(dsd["train"]) < 2:
        return datasets.DatasetDict(train=dsd["train"], validation=dsd["train"])
    # The same seeded permutation ``train_test_split`` draws, kept as in-memory index arrays: no index files
    # written next to a shared cache by every rank at once, and no tokens copied.
    train = dsd["train"]
    order = np.random.default_rng(seed).permutation(len(train))
    n_test = int(np.ceil(validation_fraction * len(train)))
    tag = f"validation-split-{validation_fraction}-{seed}"
    return datasets.DatasetDict(
        train=select_rows(train, order[n_test:], f"{tag}-train"),
        validation=select_rows(train, order[:n_test], f"{tag}-validation"),
    )


def select_rows(ds, rows: np.ndarray, tag: str):
    """``ds.select(rows, keep_in_memory=True)`` without its per-row Python work: the same in-memory indices mapping
    (composed with any mapping ``ds`` already has), built from the numpy array in Arrow.

    ``datasets`` turns the indices into a Python list first (~100 MB of int objects for 2.5 M rows, kept by the
    allocator after they are freed); ``tag`` names the selection in the new fingerprint.
    """
    import hashlib

    import datasets
    import pyarrow as pa

    rows = np.asarray(rows, dtype=np.int64)
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= len(ds)):
        raise IndexError(f"row indices must lie in [0, {len(ds)}); got {int(rows.min())}..{int(rows.max())}.")
    indices = pa.array(rows.astype(np.uint64), type=pa.uint64())
    if ds._indices is not None:
        indices = ds._indices.column(0).take(indices)
    digest = hashlib.blake2b(rows.data, digest_size=16)
    digest.update(f"{ds._fingerprint}-{tag}".encode())
    fingerprint = digest.hexdigest()
    selected = datasets.Dataset(
        ds._data,
        info=ds.info.copy(),
        split=ds.split,
        indices_table=datasets.table.InMemoryTable(pa.table({"indices": indices})),
        fingerprint=fingerprint,
    )
    if ds._format_type is not None or ds._format_columns is not None or ds._format_kwargs:
        # the format travels with the rows, as ``select`` passes it on (and keeps the fingerprint)
        selected.set_format(
            type=ds._format_type,
            columns=ds._format_columns,
            output_all_columns=ds._output_all_columns,
            **ds._format_kwargs,
        )
        selected._fingerprint = fingerprint
    return selected
