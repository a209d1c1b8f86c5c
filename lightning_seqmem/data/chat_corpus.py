"""Built-in conversational corpus: the built-in corpus's documents turned into multi-turn chats, no download.

Each exchange is a user question about a documented module, class or function (made from the docstring's first
line) and the whole docstring as the answer; the modules the corpus keeps as full source become requests for that
source, which gives the long tail that truncation and packing must handle. A conversation has 1 to 6 exchanges
(2 to 12 turns), one in three opens with a system message. Deterministic: the same Python install gives the same
conversations (choices by content hash, documents taken in the corpus's order).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

SYSTEM_PROMPT = "You answer questions about the Python standard library, quoting its documentation."
MAX_EXCHANGES = 6
_QUESTIONS = (
    'What does the code documented as "{}" do?',
    "Explain this part of the standard library: {}",
    "Tell me more about: {}",
    'I found "{}" in the Python docs. What does it mean?',
)
_SOURCE_QUESTION = "Show me the source of the standard-library module that starts with: {}"


def _hash(text: str) -> int:
    return int(hashlib.sha1(text.encode("utf-8")).hexdigest()[:8], 16)


def _is_source(doc: str) -> bool:
    """The corpus's full-source documents (its docstrings are prose)."""
    return any(marker in doc for marker in ("\nimport ", "\ndef ", "\nclass ", "\nfrom "))


def _question(doc: str) -> str:
    first_line = next((line.strip() for line in doc.splitlines() if line.strip()), doc.strip())[:200]
    template = _SOURCE_QUESTION if _is_source(doc) else _QUESTIONS[_hash(doc) % len(_QUESTIONS)]
    return template.format(first_line)


def conversations_from_documents(documents: Sequence[str]) -> list[dict]:
    """``[{"messages": [...]}, ...]``: consecutive documents grouped into conversations of 1 to 6 exchanges.

    Example::

        >>> rows = conversations_from_documents(["Return the sum of the two numbers given."])
        >>> [m["role"] for m in rows[0]["messages"]][-2:]
        ['user', 'assistant']
    """
    rows, i = [], 0
    while i < len(documents):
        seed = _hash(documents[i])
        exchanges = documents[i : i + 1 + seed % MAX_EXCHANGES]
        messages = [{"role": "system", "content": SYSTEM_PROMPT}] if seed // MAX_EXCHANGES % 3 == 0 else []
        for doc in exchanges:
            messages.append({"role": "user", "content": _question(doc)})
            messages.append({"role": "assistant", "content": doc})
        rows.append({"messages": messages})
        i += len(exchanges)
    return rows


def load_builtin_chat_corpus() -> dict[str, list[dict]]:
    """The built-in corpus's ``train`` and ``validation`` splits as conversations (``{"messages": [...]}`` rows)."""
    from lightning_seqmem.data.corpus import load_builtin_corpus

    corpus = load_builtin_corpus(verbose=False)
    # ``[:]``: the column as one list (indexing a lazy datasets Column reads Arrow once per document, 4x slower)
    return {split: conversations_from_documents(corpus[split]["text"][:]) for split in ("train", "validation")}
