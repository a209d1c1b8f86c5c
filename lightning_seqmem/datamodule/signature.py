"""What decides the train rows, for every read path: one source or a ``Mix``, map-style or streamed.

A saved loader position means something only for the same rows in the same batches. :func:`read_signature` is the
one builder of what a checkpoint records about them; the read modes add only what identifies their sources (a
checksum of the planned row lengths, or a stream's shards and files). :func:`changed_settings` names a difference
in the user's words (``batching: Pack() -> Pad()``, ``weights: {'web': 0.7, ...} -> {...}``, ``tokenizer: changed``),
never in derived numbers when a setting explains it. No Lightning import.
"""

from __future__ import annotations

import zlib
from dataclasses import fields
from typing import Any

import numpy as np

from lightning_seqmem.batching.options import Pack, Pad, Truncate

__all__ = ["IDENTITY", "LAYOUT", "changed_settings", "elastic_settings", "read_signature", "rows_identity"]

LAYOUT = ("world_size", "num_workers")
"""How the rows are dealt to readers: compared by the read path's own rule (:func:`elastic_settings`)."""
IDENTITY = ("train_rows", "train_lengths_crc32", "stream_shards", "stream_files", "validation_documents_crc32")
"""What identifies the documents (per source of a mix: ``key/name``); named ``dataset`` in a message."""
_BATCHING = {"strategy", "overflow", *(f.name for option in (Pad, Truncate, Pack) for f in fields(option))}


def world_size() -> int:
    """The number of ranks that share the rows (1 without a process group)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def read_signature(
    kind: Any,
    settings: Any,
    streaming: bool,
    tokenizer_key: str | None,
    identity: dict[str, Any],
    mix: Any = None,
    mix_seed: int | None = None,
) -> dict[str, Any]:
    """The signature of a read path: the batching settings (``Kind.signature``) and the train ``batching`` as the
    user wrote it, the data kind, ``streaming``, the tokenizer's content (``tokenizer_key``; ``None`` for token ids,
    which no tokenizer changes), how the rows are dealt (``world_size``, ``num_workers``), a stream's window and
    shuffle buffer, a mix's sources and weights by name, and ``identity`` (the read mode's, :data:`IDENTITY`)."""
    rows = kind.signature(settings)
    out = dict(rows, batching=_in_words(settings.batching.batching, rows))
    out.update(kind=kind.name + (" (token ids)" if kind.pretokenized else ""), streaming=streaming)
    out.update(world_size=world_size(), num_workers=settings.data.num_workers)
    if tokenizer_key is not None:
        out["tokenizer"] = tokenizer_key
    if streaming:
        out["streaming_buffer_size"] = settings.data.streaming_buffer_size
        out["streaming_shuffle_buffer"] = settings.data.streaming_shuffle_buffer
    if mix is not None:
        out["sources"] = list(mix.names)
        out["weights"] = {name: round(w, 12) for name, w in zip(mix.names, mix.weights)}
        out.update(mix_by=mix.by, mix_exhausted=mix.exhausted, mix_seed=mix_seed)
    return dict(out, **identity)


def _in_words(batching: Any, rows: dict[str, Any]) -> str:
    """The train batching as the user writes it, with only what decides the rows (``overflow`` resolved for the
    data kind): ``Pack(method='bfd', overflow='split')``, ``Pad()``."""
    decided = {k: rows.get(k, v) for k, v in batching.signature().items() if k != "strategy"}
    if batching.packs:
        decided["overflow"] = rows["overflow"]
    defaults = {f.name: f.default for f in fields(batching)}
    shown = [f"{k}={v!r}" for k, v in decided.items() if k in batching.shown or v != defaults.get(k)]
    return f"{type(batching).__name__}({', '.join(shown)})"


def rows_identity(train_lengths: np.ndarray | None) -> dict[str, Any]:
    """Map-style rows: their count and a checksum of their lengths (another dataset shows there)."""
    lengths = np.ascontiguousarray(train_lengths if train_lengths is not None else np.zeros(0), dtype=np.int64)
    return {"train_rows": int(lengths.size), "train_lengths_crc32": zlib.crc32(lengths)}


def elastic_settings(signature: dict[str, Any]) -> tuple[str, ...]:
    """The layout settings a resume may change. Map-style: the workers (the sampler decides every batch), not the
    ranks (a rank's position is every ``world``-th batch). Streams: both; the stream loader deals the saved readers
    out again, or refuses itself where it cannot (docs/resuming.md)."""
    return LAYOUT if signature.get("streaming") else ("num_workers",)


def changed_settings(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Each setting that differs, in the user's words; a setting a checkpoint did not record (saved by an earlier
    version) is not compared. What identifies the documents is named ``dataset`` only when no setting explains it."""
    elastic = elastic_settings(now)
    changed = {k: (saved[k], now[k]) for k in now if k in saved and saved[k] != now[k] and k not in elastic}
    options = ""  # the batching's own options that changed, named after it
    if "batching" in changed:
        parts = [f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items() if k in _BATCHING]
        options = f" ({', '.join(parts)})" if parts else ""
        changed = {k: v for k, v in changed.items() if k not in _BATCHING}
    identity = {k: v for k, v in changed.items() if k.split("/")[0] in IDENTITY}
    out = []
    for key, (old, new) in changed.items():
        if key in identity:
            continue
        if key == "tokenizer":
            out.append("tokenizer: changed")
        else:  # the batching as the user writes it: Pack(method='bfd') -> Pad()
            out.append(f"{key}: {old} -> {new}{options}" if key == "batching" else f"{key}: {old!r} -> {new!r}")
    if identity and not out:
        numbers = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in identity.items() if "crc32" not in k)
        out.append(f"dataset: other documents ({numbers or 'the train rows have other lengths'})")
    return out
