"""The tokenizer's Rust backend as every encoder here uses it: never padding nor truncating."""

from __future__ import annotations


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
