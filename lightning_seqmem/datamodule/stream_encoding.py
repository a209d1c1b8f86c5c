"""Encoding a stream one document at a time: which kind a stream holds, and per kind the function that turns one
example into what ``StreamingPacker`` takes, truncated as the map-style pipeline truncates it, with every token it
cuts added to the pass's ``Counter`` (``streaming.StreamCounts``). No Lightning import."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

from lightning_seqmem.batching.strategies import Strategy
from lightning_seqmem.data.encode import batch_encoder, document_frame

STREAM_KINDS = ("text", "conversations", "prompt_completion", "tokens", "prompt_completion_tokens")
"""What a stream may hold: text, conversations (``messages``), prompt/completion text, token ids (``input_ids``
[+ ``labels``], or ``prompt_ids`` and ``completion_ids``). Each is encoded and truncated one document at a time,
as the map-style pipeline does it."""


def stream_kind(stream: Any, text_column: str = "text") -> str:
    """One of :data:`STREAM_KINDS`, from the stream's columns (its features, else its first row), by the rule
    ``columns.check_columns`` applies to map-style data.

    Raises:
        ValueError: preference pairs, which need the whole split (they are planned over it): the message says to
            load without ``streaming=True``; or no usable column.
    """
    from types import SimpleNamespace

    from lightning_seqmem.data.columns import check_columns

    train = stream["train"] if isinstance(stream, dict) else stream
    features = getattr(train, "features", None)
    columns = list(features) if features else list(next(iter(train.take(1)), {}))
    kind = check_columns({"train": SimpleNamespace(column_names=columns, features=features)}, text_column)
    if kind not in STREAM_KINDS:
        raise ValueError(
            f"A stream of {kind.replace('_', ' ')} (columns {sorted(columns)}) cannot be served on the fly: "
            "preference pairs are planned and batched over the whole split. Load the dataset without "
            "streaming=True (the token cache tokenizes it once per node and memory-maps the tokens, so memory "
            "stays bounded). Streams of text, conversations ('messages'), prompt/completion text or token ids "
            "('input_ids', or 'prompt_ids' and 'completion_ids') are packed on the fly."
        )
    return kind


def stream_encoder(kind: str, tokenizer: Any, settings: Any, strategy: Strategy) -> Callable[..., Any]:
    """``encode(index, example, counts)`` for a stream of ``kind`` (``settings``: the DataModule's
    ``SeqMemSettings``): one document to what :class:`~lightning_seqmem.batching.StreamingPacker` takes."""
    if kind == "conversations":
        from lightning_seqmem.data.chat_template import ChatRenderer

        return partial(
            encode_streamed_conversation, ChatRenderer(tokenizer), settings.conversation, strategy.settings.max_length
        )
    if kind == "prompt_completion":
        return partial(
            encode_streamed_prompt_completion,
            tokenizer,
            strategy.prompt_completion_limits,
            settings.batching.completion_only_loss,
            encode=batch_encoder(tokenizer),
        )
    vocab = len(tokenizer) if tokenizer is not None else None
    if kind == "tokens":
        return partial(encode_streamed_ids, vocab)
    if kind == "prompt_completion_tokens":
        return partial(
            encode_streamed_prompt_completion_ids,
            vocab,
            strategy.prompt_completion_limits,
            settings.batching.completion_only_loss,
        )
    return partial(encode_document, tokenizer, settings.data.text_column, encode=batch_encoder(tokenizer))


def _encoded(tokenizer: Any, text: str, encode: Callable[[list[str]], list[list[int]]] | None) -> list[int]:
    """``text``'s ids, no special tokens: through ``encode`` (``data.encode.batch_encoder``, made once per stream:
    the same ids, faster) where given."""
    return encode([text])[0] if encode is not None else tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_streamed_prompt_completion(
    tokenizer: Any,
    limits: Any,
    completion_only_loss: bool,
    index: int,
    example: dict,
    counts: Counter | None = None,
    encode: Callable | None = None,
) -> dict[str, list[int]] | list:
    """One streamed prompt/completion row to ``{"input_ids", "labels"}``, framed and truncated as the map-style
    pipeline does (``max_prompt_length`` keeps the prompt's end, ``max_completion_length`` the completion's
    start); a row left without a completion is skipped and counted (``rows_without_completion``)."""
    counts = Counter() if counts is None else counts
    prompt, completion = example.get("prompt"), example.get("completion")
    for name, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, str):
            raise TypeError(
                f"Row {index} of the stream: column {name!r} is {type(value).__name__}, not a string. "
                "Filter the stream (stream.filter(...))."
            )
    prefix, suffix = document_frame(tokenizer)
    p = prefix + _encoded(tokenizer, prompt, encode)
    c = _encoded(tokenizer, completion, encode) + suffix if completion else []
    return _prompt_completion_row(p, c, limits, completion_only_loss, counts)


def encode_streamed_prompt_completion_ids(
    vocab_size: int | None,
    limits: Any,
    completion_only_loss: bool,
    index: int,
    example: dict,
    counts: Counter | None = None,
) -> dict[str, list[int]] | list:
    """One streamed pre-tokenized prompt/completion row (``prompt_ids``, ``completion_ids``, used as they are, as
    the map-style pipeline uses them), its ids checked against the vocabulary, then truncated as text rows are."""
    counts = Counter() if counts is None else counts
    parts = {name: example.get(name) for name in ("prompt_ids", "completion_ids")}
    for name, values in parts.items():
        _check_ids(index, name, values, vocab_size)
    return _prompt_completion_row(
        list(parts["prompt_ids"]), list(parts["completion_ids"]), limits, completion_only_loss, counts
    )


def _prompt_completion_row(
    p: list[int], c: list[int], limits: Any, completion_only_loss: bool, counts: Counter
) -> dict[str, list[int]] | list:
    from lightning_seqmem.batching.truncation import prompt_completion_example

    _count_document(counts, len(p) + len(c))
    row = prompt_completion_example(p, c, limits, completion_only_loss)
    counts["documents_over_max_length"] += limits.max_length is not None and len(p) + len(c) > limits.max_length
    counts["tokens_truncated"] += row["num_truncated"]
    if not row["completion_length"]:
        counts["rows_without_completion"] += 1
        counts["tokens_truncated"] += len(row["input_ids"])  # the prompt left: nothing to learn from it
        return []
    return {"input_ids": row["input_ids"], "labels": row["labels"]}


def encode_streamed_ids(
    vocab_size: int | None, index: int, example: dict, counts: Counter | None = None
) -> dict[str, list[int]] | list[int]:
    """One streamed pre-tokenized row (``input_ids`` [+ ``labels``]) as it is, its ids checked against the
    vocabulary (labels may be -100)."""
    from lightning_seqmem.batch import IGNORE_INDEX

    counts = Counter() if counts is None else counts
    ids, labels = example.get("input_ids"), example.get("labels")
    _check_ids(index, "input_ids", ids, vocab_size)
    if labels is not None:
        _check_ids(index, "labels", labels, vocab_size, extra=(IGNORE_INDEX,))
    if labels is not None and len(labels) != len(ids):
        raise ValueError(
            f"Row {index} of the stream: {len(ids)} input_ids but {len(labels)} labels; they must "
            "have one label per token."
        )
    if not len(ids):
        counts["empty_documents_skipped"] += 1
        return []
    _count_document(counts, len(ids))
    return {"input_ids": list(ids), "labels": list(labels)} if labels is not None else list(ids)


def _check_ids(index: int, name: str, values: Any, vocab_size: int | None, extra: tuple[int, ...] = ()) -> None:
    """Refuse a row's token ids that are not a list of integers in ``[0, vocab_size)`` (or in ``extra``)."""
    bad = None
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, int) for v in values):
        bad = f"must be a list of integers (got {type(values).__name__})"
    else:
        top = vocab_size if vocab_size is not None else float("inf")
        wrong = next((v for v in values if not (0 <= v < top or v in extra)), None)
        if wrong is not None:
            bad = f"holds {wrong}, outside [0, {vocab_size if vocab_size is not None else 'inf'})"
    if bad is not None:
        raise ValueError(
            f"Row {index} of the stream: {name} {bad}. Filter the stream or re-tokenize it with the "
            "tokenizer the model uses."
        )


def encode_streamed_conversation(
    renderer: Any, settings: Any, max_length: int, index: int, example: dict, counts: Counter | None = None
) -> dict[str, list[int]] | list[int]:
    """One streamed conversation to ``{"input_ids", "labels"}``, cut by whole turns to ``max_length`` as the
    split pipeline cuts them, what was cut added to ``counts``; one with no trained token is skipped (``[]``,
    counted in ``conversations_dropped_empty`` and ``tokens_dropped``) or refused, by ``on_empty_labels``."""
    from lightning_seqmem.data.chat_truncation import truncate
    from lightning_seqmem.data.conversations import MESSAGES_COLUMN, encode_conversation, select_trained

    counts = Counter() if counts is None else counts
    row = f"{index} of the stream"
    full = encode_conversation(example.get(MESSAGES_COLUMN), renderer, row, settings)
    conversation = truncate(full, max_length)
    _count_document(counts, len(full.input_ids))
    counts["documents_over_max_length"] += len(full.input_ids) > max_length
    counts["tokens_truncated"] += len(full.input_ids) - len(conversation.input_ids)
    kept, _ = select_trained([conversation.num_trained], settings.on_empty_labels, rows=[row])
    if not len(kept):
        counts["conversations_dropped_empty"] += 1
        counts["tokens_dropped"] += len(conversation.input_ids)
        return []
    counts["trained_tokens"] += conversation.num_trained
    return {"input_ids": conversation.input_ids.tolist(), "labels": conversation.labels().tolist()}


def _count_document(counts: Counter, length: int) -> None:
    counts["documents"] += 1
    counts["tokens"] += length
    counts["longest_document"] = max(counts["longest_document"], length)


def encode_document(
    tokenizer: Any,
    text_column: str,
    index: int,
    example: dict,
    counts: Counter | None = None,
    encode: Callable | None = None,
) -> list[int]:
    """One streamed document to ``[bos] + tokens + [eos]``, as ``data.encode`` does for map-style data (an empty one
    to ``[]``, counted in ``empty_documents_skipped``)."""
    counts = Counter() if counts is None else counts
    text = example.get(text_column)
    if not isinstance(text, str):
        raise TypeError(
            f"Row {index} of the stream: column {text_column!r} is {type(text).__name__}, not a string. "
            "Filter the stream (stream.filter(...)) or pass text_column=<name>."
        )
    if not text:
        counts["empty_documents_skipped"] += 1
        return []  # skipped by the packer
    prefix, suffix = document_frame(tokenizer)
    ids = prefix + _encoded(tokenizer, text, encode) + suffix
    _count_document(counts, len(ids))
    return ids
