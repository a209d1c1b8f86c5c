"""Data kinds: one object per kind of data (text, prompt/completion, conversations, preference pairs; each but
conversations also pre-tokenized) that answers every question about itself, and ``detect``, which tells them apart
by their columns. Map-style splits, the token cache and streams all ask the kind."""

from __future__ import annotations

from lightning_seqmem._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "Kind": "lightning_seqmem.kinds.base",
    "Text": "lightning_seqmem.kinds.text",
    "PromptCompletion": "lightning_seqmem.kinds.prompt_completion",
    "Conversations": "lightning_seqmem.kinds.conversations",
    "Preference": "lightning_seqmem.kinds.preference",
    "detect_dataset": "lightning_seqmem.kinds.detect",
    "detect_stream": "lightning_seqmem.kinds.detect",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
