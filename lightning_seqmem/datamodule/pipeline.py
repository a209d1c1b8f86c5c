"""The split pipeline: documents -> token source -> rows -> plan -> statistics. No Lightning import.

``SeqMemDataModule`` (its map-style read mode) runs it for train and validation and emits the warnings it returns;
``seqmem-plan`` reads the same documents (:func:`split_documents`) for its lengths, so both see the same non-empty
documents of the same validation split. What differs between kinds of data is asked of the kind
(``lightning_seqmem.kinds``). Everything works on numpy views of the Arrow columns and on lengths: no token is
copied here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_seqmem.batching.strategies import Strategy
from lightning_seqmem.data.columns import LargestTokenId, largest_of
from lightning_seqmem.data.conversations import ConversationSettings
from lightning_seqmem.data.sources import ensure_validation_split, load_text_dataset
from lightning_seqmem.kinds.base import Documents, Kind, PreparedSplit
from lightning_seqmem.kinds.detect import detect_dataset

SPLITS = ("train", "validation")
TEST = "test"  # served to trainer.test / trainer.predict when the data have it (``SeqMemDataModule.test_dataloader``)


def load_documents(
    dataset: Any,
    data: Any,
    tokenizer: Callable[[], Any],
    explicit_tokenizer: bool,
    conversation: ConversationSettings | None = None,
) -> tuple[Any, Kind, LargestTokenId | None]:
    """``(DatasetDict of token columns, kind, largest id)``: ``dataset`` tokenized through the tokenize-once cache,
    or pre-tokenized data as they are (their values checked once); ``kind`` the data kind (``kinds.detect``);
    the largest id of pre-tokenized data, over all splits (``None`` for text: its tokenizer's size bounds the ids).

    Args:
        dataset: what ``SeqMemDataModule(dataset=...)`` takes.
        data: the ``DataSettings`` (text column, cache folder, tokenization processes).
        tokenizer: gives the tokenizer when needed (loading it may be slow, and pre-tokenized data need none).
        explicit_tokenizer: the user gave one: pre-tokenized ids are checked against its vocabulary.
        conversation: how conversations become trained tokens (``train_on``, ``train_field``: part of the cache key).
    """
    from lightning_seqmem.data.token_cache import tokenize_cached
    from lightning_seqmem.data.value_checks import check_values_once

    raw = load_text_dataset(dataset)
    kind = detect_dataset(raw, data.text_column)
    if kind.pretokenized:
        vocab = len(tokenizer()) if explicit_tokenizer else None
        largest = largest_of(
            [
                check_values_once(ds, kind.column_kind, kind.id_columns, split, vocab, cache_dir=data.cache_dir)
                for split, ds in raw.items()
            ]
        )
        return raw, kind, largest
    tokenized = tokenize_cached(
        raw,
        tokenizer(),
        kind,
        data.text_column,
        num_proc=data.num_proc,
        cache_dir=data.cache_dir,
        source=dataset,
        conversation=conversation,
    )
    return kind.carry_columns(raw, tokenized), kind, None


def split_documents(tokenized: Any, kind: Kind, seed: int, test: bool = False) -> dict[str, Documents]:
    """Train and validation :class:`~lightning_seqmem.kinds.base.Documents` of a tokenized ``DatasetDict``
    (validation carved out with ``seed`` when the data have none; a ``test`` split without a ``validation`` one
    validates), and with ``test`` its ``test`` split too where it has one."""
    splits = ensure_validation_split(tokenized, seed=seed)
    docs = {split: kind.documents(splits[split]) for split in SPLITS}
    if test and TEST in tokenized:
        docs[TEST] = kind.documents(tokenized[TEST])
    return docs


def prepare_split(split: str, docs: Documents, strategy: Strategy, settings: Any) -> PreparedSplit:
    """Truncate or pack ``docs`` with ``strategy`` and count every token that will not reach the model
    (``settings``: the DataModule's ``SeqMemSettings``; the kind of ``docs`` decides which tokens carry loss and
    what truncation cuts: ``Kind.prepare``)."""
    return docs.kind.prepare(split, docs, strategy, settings)
