"""Built-in preference pairs: the built-in corpus's documents as (prompt, chosen, rejected), no download.

Each pair asks the question the chat corpus asks about a document (made from its docstring's first line); the
chosen answer is the document itself, the rejected one either another document's answer (a shuffled answer: on
topic for some other question) or the document's last third (a truncated answer that lost its beginning; cut at
its end instead, it would equal the chosen answer once ``max_completion_length`` cuts both). Enough to exercise
the preference pipeline end to end offline (different prompt and completion lengths, a long tail of full-source
answers), not a research data set. Deterministic: choices by content hash, documents in the corpus's order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from lightning_seqmem.data.chat_corpus import _hash, _question

if TYPE_CHECKING:
    import datasets

BUILTIN_PREFERENCE = "builtin_preference"
"""The ``dataset`` argument that selects this set."""

PREFERENCE_CORPUS_VERSION = 2
_SHUFFLE_SPAN = 97  # a shuffled answer comes from a document 1..97 places further on (wrapping around)


def pairs_from_documents(documents: Sequence[str]) -> list[dict[str, str]]:
    """``[{"prompt", "chosen", "rejected"}, ...]``: one pair per document (documents with less than two words of
    text are skipped: a truncated answer needs something to cut).

    Example::

        >>> rows = pairs_from_documents(["Return the sum of the two numbers given.", "Open a file and read it."])
        >>> rows[0]["chosen"], rows[0]["rejected"] != rows[0]["chosen"]
        ('Return the sum of the two numbers given.', True)
    """
    docs = [doc for doc in documents if len(doc.split()) >= 2]
    rows = []
    for i, doc in enumerate(docs):
        seed = _hash(doc)
        other = docs[(i + 1 + seed % _SHUFFLE_SPAN) % len(docs)]
        if seed % 2 and other != doc:
            rejected = other
        else:  # cut: its last third of words only (from the start it would equal chosen once both are truncated)
            words = doc.split(" ")
            rejected = " ".join(words[-max(1, len(words) // 3) :])
            if rejected == doc:
                rejected = doc[-max(1, len(doc) // 3) :]
        rows.append({"prompt": _question(doc), "chosen": doc, "rejected": rejected})
    return rows


def load_builtin_preference_corpus() -> datasets.DatasetDict:
    """The built-in corpus's ``train`` and ``validation`` splits as preference pairs; built once and cached next to
    the corpus (so its fingerprint, and the token cache's key, are stable across processes)."""
    import os

    import datasets

    from lightning_seqmem.data.corpus import corpus_path, load_builtin_corpus

    path = corpus_path().with_name(f"{corpus_path().name}-preference-v{PREFERENCE_CORPUS_VERSION}")
    if not (path / "dataset_dict.json").exists():
        corpus = load_builtin_corpus(verbose=False)
        dsd = datasets.DatasetDict(
            {
                split: datasets.Dataset.from_list(pairs_from_documents(corpus[split]["text"][:]))
                for split in ("train", "validation")
            }
        )
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        dsd.save_to_disk(str(tmp))
        try:
            os.replace(tmp, path)  # atomic, as the corpus
        except OSError:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return datasets.load_from_disk(str(path))
