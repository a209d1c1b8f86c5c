"""Local files and hub names as datasets: a path, glob, directory or list of json/jsonl/parquet/txt/csv files (one
kind at a time), a ``save_to_disk`` folder, or a hub name; a file that cannot be read named with its line."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Sequence

from lightning_seqmem.messages import short_repr

LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv"}


def matches(item: str) -> list[str]:
    """The files one path or glob names (a directory counts as itself); empty when it names nothing."""
    if any(c in item for c in "*?["):
        return sorted(glob.glob(item))
    return [item] if os.path.exists(item) else []


def local_files(spec: str | Sequence[str]) -> list[str] | None:
    """Local files named by a path, a glob or a list of them; None when ``spec`` does not look local."""
    items = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    files: list[str] = []
    for item in items:
        for match in matches(os.fspath(item)):
            if os.path.isdir(match):  # a folder in a list: its files of the known kinds
                files.extend(sorted(f for ext in LOCAL_BUILDERS for f in glob.glob(os.path.join(match, f"*{ext}"))))
            elif os.path.isfile(match):
                files.append(match)
    return files or None


def looks_like_file_name(item: str) -> bool:
    return not any(c.isspace() for c in item) and os.path.splitext(item)[1].lower() in LOCAL_BUILDERS


def load_path_or_name(spec, streaming: bool = False):
    """A ``save_to_disk`` folder, local files (a path, glob, directory or list) or a hub name, as a ``DatasetDict``;
    with ``streaming``, files and hub names as an ``IterableDatasetDict`` (a saved folder stays map-style)."""
    import datasets

    if isinstance(spec, (str, os.PathLike)) and os.path.isdir(spec):
        if os.path.exists(os.path.join(spec, "dataset_dict.json")) or os.path.exists(
            os.path.join(spec, "dataset_info.json")
        ):
            loaded = datasets.load_from_disk(os.fspath(spec))
            return loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict(train=loaded)
        files = local_files([os.path.join(spec, f"*{ext}") for ext in LOCAL_BUILDERS])
        if not files:
            raise ValueError(f"Directory {short_repr(os.fspath(spec))} holds no {'/'.join(LOCAL_BUILDERS)} files.")
    else:
        files = local_files(spec)
    if files is not None:
        return load_local_files(files, streaming)
    name = os.fspath(spec) if not isinstance(spec, (list, tuple)) else None
    if name is None or _looks_like_path(name):
        what = "matches no file" if name is not None and any(c in name for c in "*?[") else "does not exist"
        raise FileNotFoundError(
            f"Dataset path {short_repr(spec)} {what} (relative paths start at {short_repr(os.getcwd())}). Pass an "
            f"existing file, glob, directory or list of {'/'.join(LOCAL_BUILDERS)} files, a datasets.Dataset, or "
            "dataset='builtin'."
        )
    try:
        return datasets.load_dataset(name, streaming=streaming)
    except Exception as err:
        raise FileNotFoundError(
            f"Could not load dataset {short_repr(name)}: it is not a local path, and loading it by name failed "
            f"({type(err).__name__}: {short_repr(str(err))}). Check the name, or download it and pass the local path."
        ) from err


def _looks_like_path(name: str) -> bool:
    """A local path rather than a hub name (``org/name``): starts with ``.``, ``/`` or ``~``, has more than one
    ``/``, or ends in a file extension we read."""
    return (
        name.startswith((".", "/", "~"))
        or os.sep in name.rstrip("/").split("/", 1)[-1]
        or os.path.splitext(name)[1].lower() in LOCAL_BUILDERS
    )


def load_local_files(files: Sequence[str], streaming: bool = False):
    """Local files of one kind as ``DatasetDict(train=...)`` (with ``streaming``, an ``IterableDatasetDict``, read
    as it is iterated).

    Raises:
        ValueError: mixed or unknown extensions; an empty file; a file ``datasets`` cannot read (the message names
            the file and, for JSON, the line and what is wrong with it).
    """
    import datasets

    exts = {os.path.splitext(f)[1].lower() for f in files}
    unknown = exts - set(LOCAL_BUILDERS)
    if unknown or len({LOCAL_BUILDERS[e] for e in exts}) != 1:
        raise ValueError(
            f"Cannot read files with extensions {sorted(exts)} together; use one of "
            f"{sorted(LOCAL_BUILDERS)} (all files of one kind)."
        )
    for path in files:
        if _is_blank(path):
            raise ValueError(f"{path} is empty: there are no rows to read. Remove it from the dataset or fill it.")
    builder = LOCAL_BUILDERS[exts.pop()]
    try:
        loaded = datasets.load_dataset(builder, data_files={"train": list(files)}, streaming=streaming)
    except Exception as err:
        raise ValueError(_read_error(files, builder, err)) from err
    if streaming:  # a stream reads its files only as it is trained on: check now that they agree with the first
        problem = disagreeing_files(files, builder, loaded["train"].features)
        if problem:
            raise ValueError(problem)
        if all(f.lower().endswith((".jsonl", ".txt")) for f in files):  # line files: shards a resume can seek to
            from lightning_seqmem.data.line_ranges import line_range_stream

            # rows as JSON gives them (checked against the first file above): casting each to the features would
            # cost more than reading it (0.63 s against 2.65 s for 200,000 short rows)
            return datasets.IterableDatasetDict(train=line_range_stream(files, builder))
    return loaded


def disagreeing_files(files: Sequence[str], builder: str, features) -> str | None:
    """What makes JSON Lines or Parquet ``files`` unreadable as one stream, ``None`` if nothing does: ``datasets``
    reads every file with the columns (``features``) it found in the first one, and fails, naming no file, on a
    file with a column the first lacks or a column of another shape (a list where the first has a string).

    Cheap: a file's first row (JSON Lines) or its schema (Parquet footer), never the whole file.
    """
    if features is None or builder not in ("json", "parquet") or len(files) < 2:
        return None
    first, want = files[0], {name: _shape(feature) for name, feature in features.items()}
    problems = []
    for path in files[1:]:
        columns = _first_columns(path, builder)
        extra = sorted(set(columns) - set(want))
        if extra:
            missing = sorted(set(want) - set(columns))
            lacks = f" (and lacks {missing})" if missing else ""
            problems.append(f"{path} has column(s) {extra} that {first} lacks{lacks}")
        for name in sorted(set(columns) & set(want)):
            if columns[name] is not None and columns[name] != want[name]:
                problems.append(f"{path}'s column {name!r} holds {columns[name]} where {first}'s holds {want[name]}")
    if not problems:
        return None
    return (
        f"The stream's files disagree with its first file, {first} (columns {sorted(want)}): "
        + "; ".join(problems[:5])
        + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        + ". datasets reads every file with the first file's columns, so these would fail mid-training. Give every "
        "file the same columns with the same types (rename or convert the odd ones), or drop them from the dataset."
    )


def _first_columns(path: str, builder: str) -> dict[str, str | None]:
    """Column name -> shape (:func:`_shape`) of a file: a Parquet file's schema, a JSON Lines file's first row
    (``None`` for a null value, whose shape is unknown); empty for a JSON array file (not read: it parses whole)."""
    if builder == "parquet":
        import datasets
        import pyarrow.parquet as pq

        return {name: _shape(f) for name, f in datasets.Features.from_arrow_schema(pq.read_schema(path)).items()}
    with open(path, encoding="utf-8", errors="replace") as f:
        line = next((line for line in f if line.strip()), "")
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return {}  # a JSON array, or a bad line: told as it is read (json_problem)
    if not isinstance(row, dict):
        return {}
    return {name: None if value is None else _shape(value) for name, value in row.items()}


def _shape(item) -> str:
    """``"a list"``, ``"an object"`` or a single value: of a ``datasets`` feature or a parsed JSON value. Only
    these differ in a way ``datasets`` cannot cast (a number read where text is expected becomes text)."""
    import datasets

    lists = tuple(
        kind for name in ("List", "LargeList", "Sequence") if isinstance(kind := getattr(datasets, name, None), type)
    )
    if isinstance(item, (list, *lists)):
        return "a list"
    if isinstance(item, dict):
        return "an object"
    return "a single value (text or number)"


def _is_blank(path: str, probe: int = 1 << 16) -> bool:
    """True for an empty or whitespace-only file (reads at most the first 64 KiB unless they are all blank)."""
    with open(path, "rb") as f:
        while chunk := f.read(probe):
            if chunk.strip():
                return False
    return True


def _read_error(files: Sequence[str], builder: str, err: Exception) -> str:
    """Say which file (and line) ``datasets`` could not read, and what is wrong; only called after a failure."""
    if builder == "json":
        for path in files:
            problem = json_problem(path)
            if problem:
                return problem
    cause = err.__cause__ or err.__context__ or err
    where = files[0] if len(files) == 1 else f"one of {len(files)} {builder} files (first: {files[0]})"
    return (
        f"Could not read {where}: {type(cause).__name__}: {short_repr(str(cause))}. Check that every file is "
        f"valid {builder}."
    )


def json_problem(path: str) -> str | None:
    """The first problem in a JSON (array) or JSON Lines file: file, line and what is wrong; None when it parses.

    Every row must be a JSON object (``{"text": ...}``).
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(1 << 16).lstrip()
        f.seek(0)
        if head.startswith("["):  # one JSON array of rows
            try:
                rows = json.load(f)
            except json.JSONDecodeError as err:
                return f"{path}, line {err.lineno}, column {err.colno}: invalid JSON ({err.msg})."
            bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
            if bad is not None:
                return (
                    f"{path}: item {bad} of the JSON array is a {type(rows[bad]).__name__}, not an object; "
                    'every row must be an object such as {"text": "..."}.'
                )
            return None
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                return (
                    f"{path}, line {number}, column {err.colno}: invalid JSON ({err.msg}): "
                    f"{short_repr(line.rstrip())}. JSON Lines needs one complete object per line."
                )
            if not isinstance(row, dict):
                return (
                    f"{path}, line {number}: a JSON {type(row).__name__}, not an object; every line must be "
                    'an object such as {"text": "..."}.'
                )
    return None
