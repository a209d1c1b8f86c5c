"""Generated chat data for ``benchmarks/chat.py``: conversations and conversation pairs, deterministic by seed,
words from a fixed vocabulary."""

from __future__ import annotations

import random

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "for",
    "that",
    "with",
    "as",
    "on",
    "by",
    "this",
    "from",
    "at",
    "be",
    "are",
    "or",
    "an",
    "it",
    "which",
    "module",
    "function",
    "returns",
    "value",
    "list",
    "string",
    "file",
    "path",
    "object",
    "class",
    "method",
    "argument",
    "default",
    "error",
    "raise",
    "python",
    "data",
    "time",
]


def conversations(n: int, seed: int = 0):
    """``n`` conversations of 2 to 12 turns (user 5-60 words, assistant 10-200), a third with a system message."""
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))

    for i in range(n):
        messages = [{"role": "system", "content": text(5, 20)}] if i % 3 == 0 else []
        for _ in range(rng.randint(1, 6)):
            messages += [{"role": "user", "content": text(5, 60)}, {"role": "assistant", "content": text(10, 200)}]
        yield {"messages": messages}


def pairs(n: int, seed: int = 0):
    """``n`` conversation pairs: the turns before the last assistant turn as the prompt, that turn as ``chosen``,
    a fresh answer (10-200 words) as ``rejected``."""
    rng = random.Random(seed + 1)
    for row in conversations(n, seed):
        messages = row["messages"]
        other = " ".join(rng.choices(WORDS, k=rng.randint(10, 200)))
        yield {"prompt": messages[:-1], "chosen": messages[-1:], "rejected": [{"role": "assistant", "content": other}]}
