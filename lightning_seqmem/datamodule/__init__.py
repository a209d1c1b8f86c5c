"""``SeqMemDataModule`` and what it is made of: the settings, the read paths (one source or a ``Mix``, map-style or
streamed), the split pipeline and resume. The stream engine itself is ``lightning_seqmem.streams``."""

from __future__ import annotations

from lightning_seqmem._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "SeqMemDataModule": "lightning_seqmem.datamodule.module",
    "SeqMemSettings": "lightning_seqmem.datamodule.settings",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
