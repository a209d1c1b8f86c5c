"""The tokenizer's Rust backend as every encoder here uses it: never padding nor truncating; and its fingerprint,
taken of that same backend, so that what identifies a tokenizer is what the encoders use."""

from __future__ import annotations

import hashlib
from typing import Any


def plain_backend(tokenizer):
    """The tokenizer's Rust backend without padding or truncation: the backend itself where ``tokenizer.json``
    sets neither, else a copy with both turned off; ``None`` for a tokenizer without one.

    A ``tokenizer.json`` may pin padding and truncation in the backend (sentence-transformers tokenizers pin both,
    e.g. to 128): encoding with that backend directly would pad every document with ``[PAD]`` ids to that length
    and cut longer ones without a count. ``transformers`` turns them off only while its own ``__call__`` runs
    (so it depends on whether the tokenizer was called before); a copy leaves the user's tokenizer as it is.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or (backend.padding is None and backend.truncation is None):
        return backend
    import copy

    backend = copy.deepcopy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what the encoders use of ``tokenizer`` (the token cache's key, a stream's resume signature): its
    serialised backend without padding and truncation (:func:`plain_backend`: vocabulary, merges, normaliser, added
    tokens) and its special tokens, for fast tokenizers; ``datasets``' pickling hash for anything else.

    Padding and truncation are left out because ``transformers`` switches them on the backend at every call
    (``tok(text, truncation=True, max_length=8)`` leaves ``max_length=8`` set until the next call) and a
    ``tokenizer.json`` may pin them: hashing them made the same tokenizer, loaded afresh after a preemption, refuse
    the checkpoint it had written and miss its own cache entries.
    """
    h = hashlib.sha256(type(tokenizer).__qualname__.encode())
    backend = plain_backend(tokenizer)
    if backend is not None and hasattr(backend, "to_str"):
        h.update(backend.to_str().encode())
        h.update(repr(sorted((k, str(v)) for k, v in getattr(tokenizer, "special_tokens_map", {}).items())).encode())
    else:
        from datasets.fingerprint import Hasher

        h.update(Hasher.hash(tokenizer).encode())
    return h.hexdigest()
