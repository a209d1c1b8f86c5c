"""Plain text (a ``text`` column), or its token ids (``input_ids``, optionally ``labels``): one document per row,
framed with the tokenizer's BOS/EOS, every token trained on (or the row's own labels)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from lightning_seqmem.batching.strategies import Strategy
from lightning_seqmem.data.tokens import view_of_dataset
from lightning_seqmem.kinds.base import Documents, Kind, SplitRows, count_document


class Text(Kind):
    """Text documents; pre-tokenized: ``input_ids`` [+ ``labels``, one per token, -100 where untrained]."""

    name = "text"
    parts = {"documents": "input_ids"}

    @property
    def id_columns(self) -> tuple[str, ...]:
        return ("input_ids", "labels")

    @property
    def column_kind(self) -> str:
        return "tokens" if self.pretokenized else "text"

    def source_columns(self, text_column: str = "text") -> list[str]:
        return list(self.id_columns) if self.pretokenized else [text_column]

    def text_encoder(self, tokenizer: Any, text_column: str, conversation: Any):
        from lightning_seqmem.data.encode import text_function

        return text_function(tokenizer, text_column)

    def label_view(self, ds: Any) -> Any:
        return view_of_dataset(ds, "labels") if "labels" in ds.column_names else None

    def split_rows(self, split: str, docs: Documents, strategy: Strategy, settings: Any) -> SplitRows:
        return SplitRows(docs.parts["documents"], docs.labels, docs.dataset)

    def stream_row(self, row: dict, index: Any, settings: Any, strategy: Strategy, counts: Counter):
        ids = row["input_ids"]
        if not len(ids):
            counts["empty_documents_skipped"] += 1
            return []  # skipped by the packer
        count_document(counts, len(ids))
        return {"input_ids": ids, "labels": row["labels"]} if row.get("labels") is not None else ids


def text_stream_encoder(tokenizer: Any, text_column: str = "text"):
    """``encode(index, example, counts)`` of a text stream (``Kind.stream_encoder`` with only what text needs): one
    document framed as map-style text is, ``[]`` (counted as empty) when it has no token."""
    from types import SimpleNamespace

    settings = SimpleNamespace(data=SimpleNamespace(text_column=text_column), conversation=None)
    return Text().stream_encoder(tokenizer, settings, None, "train")
