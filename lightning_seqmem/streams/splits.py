"""How a stream becomes its splits: its own validation split, else its first documents, held as a list, with
training left the rest (copies of a validation document left out too, counted as they are read). No Lightning
import."""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["LEFT_OUT", "NotIn", "example_key", "left_out_warning", "streaming_splits"]

LEFT_OUT = "documents_left_out_as_validation"
"""The ``stats()`` key of the training stream's documents left out as validation: the validation head itself (read
again by training, which reads the stream from its start) and every copy of a validation document further on, so
that ``documents`` plus this count is every document training read."""


def streaming_splits(dataset: Any, validation_documents: int) -> tuple[dict[str, Any], NotIn | None]:
    """``({"train", "validation"}, leave_out)``: the dataset's own validation split, else the stream's first
    ``validation_documents`` documents, read here and held as a list, with training left the rest; and the
    dataset's ``test`` split where it has one.

    Training leaves them out by content (``leave_out``, a :class:`NotIn` that its reader asks of every document;
    ``None`` for a stream's own validation split), not with ``skip``: under loader workers and DDP ranks
    ``datasets`` splits a ``skip``/``take`` count across the shards each reader gets, so the documents skipped
    would depend on the number of readers. A document equal to a validation document is left out of training too.
    """
    train, val = (dataset["train"], dataset.get("validation")) if isinstance(dataset, dict) else (dataset, None)
    leave_out = None
    if val is None:
        head = list(train.take(validation_documents + 1))  # one more: is anything left to train on?
        if len(head) <= validation_documents:
            raise ValueError(
                f"The stream holds {len(head)} documents, and the first streaming_validation_documents="
                f"{validation_documents} go to validation: nothing would be left to train on. Lower "
                "streaming_validation_documents, or give the stream its own 'validation' split."
            )
        val = head[:validation_documents]
        leave_out = NotIn(val) if val else None
    test = dataset.get("test") if isinstance(dataset, dict) else None
    return {"train": train, "validation": val, **({"test": test} if test is not None else {})}, leave_out


class NotIn:
    """``True`` for an example that is not one of ``examples`` (compared by a hash of its content): picklable,
    so loader workers can run it."""

    def __init__(self, examples: list[dict]) -> None:
        self.keys, self.held = frozenset(map(example_key, examples)), len(examples)

    def __call__(self, example: dict) -> bool:
        return example_key(example) not in self.keys


def example_key(example: dict) -> bytes:
    """A 16-byte digest of an example's content, the same in every process."""
    text = json.dumps(example, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def left_out_warning(count: int, held: int) -> str | None:
    """What a training pass that left out ``count`` documents as validation says, where ``held`` validation
    documents cannot account for them all (so copies of them were left out too); else ``None``."""
    if count <= held:
        return None
    return (
        f"train stream: {count} document(s) read in this pass were left out of training as validation documents: "
        f"the {held} validation document(s) and at least {count - held} copies of them further on "
        f"(stats()['train'][{LEFT_OUT!r}]). The validation head is carved out of the stream by content, so its "
        "copies go too. To train on them, give the stream its own 'validation' split."
    )
