"""Where lightning_seqmem keeps what it builds once and reuses: the built-in corpus and tokenizer, tokenized splits,
packing plans. One root for all of them, so ``seqmem-cache`` lists and removes them in one place."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_cache_dir"]


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lightning_seqmem``, else ``~/.cache/lightning_seqmem``."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "lightning_seqmem"
