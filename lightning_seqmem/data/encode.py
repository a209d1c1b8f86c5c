"""Documents to token ids: the special tokens around a document, the fast batch encoder, and the batched map
function of each data kind (``fn(batch, indices, split) -> token columns``). The kinds (``lightning_seqmem.kinds``)
choose among them; the token cache, ``datasets.map`` and streams all run the one a kind gives."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lightning_seqmem.data.backend import plain_backend
from lightning_seqmem.data.columns import PREFERENCE_IDS, PREFERENCE_TEXT


def _check_strings(batch: dict, columns: Sequence[str], indices: Sequence[int], split: str) -> None:
    for column in columns:
        for idx, value in zip(indices, batch[column]):
            if not isinstance(value, str):
                raise TypeError(
                    f"Row {idx} of split {split!r}, column {column!r} is {type(value).__name__} ({value!r:.60}), "
                    "not a string. "
                    "Clean the dataset (e.g. dataset.filter(lambda r: isinstance(r[col], str))) or cast the column."
                )


def document_frame(tokenizer, add_bos: bool | None = None, add_eos: bool = True) -> tuple[list[int], list[int]]:
    """The special tokens around every document: ``([bos], [eos])``.

    BOS only where the tokenizer has one that differs from EOS (GPT-2 style tokenizers use one token for both,
    and packing already separates documents), unless ``add_bos`` says otherwise.
    """
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if add_bos is None:
        add_bos = bos is not None and bos != eos
    return ([bos] if add_bos and bos is not None else []), ([eos] if add_eos and eos is not None else [])


def int_ids_feature():
    """The ``datasets`` feature of a token-id list: int32 ids (half the disk and page cache of int64)."""
    import datasets

    sequence = datasets.List if hasattr(datasets, "List") else datasets.Sequence
    return sequence(datasets.Value("int32"))


def token_features(names: Sequence[str]):
    """The ``datasets.Features`` of tokenized rows: int32 id columns ``names``, then their summed ``length``."""
    import datasets

    return datasets.Features({**{n: int_ids_feature() for n in names}, "length": datasets.Value("int64")})


def conversation_features():
    """The ``datasets.Features`` of tokenized conversations (``conversations.EncodedConversation.to_row``, its
    trained-token count and length)."""
    import datasets

    ids = int_ids_feature()
    return datasets.Features(
        {
            "input_ids": ids,
            "label_spans": ids,
            "turn_ends": ids,
            "keep_turns": datasets.Value("int32"),
            "num_truncated": datasets.Value("int32"),
            "num_trained": datasets.Value("int64"),
            "length": datasets.Value("int64"),
        }
    )


def batch_encoder(tokenizer) -> Callable[[list[str]], list[list[int]]]:
    """``encode(texts) -> ids per text`` (no special tokens): the tokenizer's ``__call__``, or, for a stock fast
    tokenizer, its Rust backend's ``encode_batch_fast``, which skips the offsets, token strings and masks that
    ``__call__`` builds and throws away (about 1.6x faster, and less memory per batch; 1.5x for one text at a time).

    The backend is used only where it must give the same ids: a ``transformers`` fast tokenizer whose encoding
    methods are not overridden; and the first batch is encoded both ways and compared, falling back to
    ``__call__`` for good on any difference. The encoder pickles (loader workers and ``datasets.map`` processes
    each check their own first batch). Neither way pads or truncates, whatever the tokenizer's files say
    (:func:`plain_backend`).
    """
    return BatchEncoder(tokenizer)


class BatchEncoder:
    """What :func:`batch_encoder` returns: a picklable callable."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.backend = backend = plain_backend(tokenizer)
        methods = [getattr(type(tokenizer), name, None) for name in ("__call__", "_encode_plus", "_batch_encode_plus")]
        stock = all(getattr(m, "__module__", "").startswith("transformers.") for m in methods if m is not None)
        self.fast = not (
            backend is None
            or not hasattr(backend, "encode_batch_fast")
            or not getattr(tokenizer, "is_fast", False)
            or not stock
            or getattr(backend, "encode_special_tokens", False)
            != bool(getattr(tokenizer, "split_special_tokens", False))
        )
        self.checked = not self.fast

    def call(self, texts: list[str]) -> list[list[int]]:
        # Only the ids: an attention mask would be one more Python int per token, thrown away. Never padded nor
        # cut, whatever the tokenizer's files or an earlier call set.
        return self.tokenizer(
            list(texts),
            add_special_tokens=False,
            padding=False,
            truncation=False,
            return_attention_mask=False,
            return_token_type_ids=False,
        )["input_ids"]

    def __call__(self, texts: list[str]) -> list[list[int]]:
        texts = list(texts)
        if not self.fast:
            return self.call(texts)
        ids = [e.ids for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)]
        if not self.checked:
            self.checked = True
            self.fast = ids == self.call(texts)
            if not self.fast:
                return self.call(texts)
        return ids


def text_function(tokenizer, text_column: str = "text", add_bos: bool | None = None, add_eos: bool = True):
    """The batched map function of text: ``fn(batch, indices, split) -> {"input_ids", "length"}``, each document
    framed (``document_frame``); a document with no token is ``[]`` (kept, so it is counted as empty)."""
    prefix, suffix = document_frame(tokenizer, add_bos, add_eos)
    encode = batch_encoder(tokenizer)

    def fn(batch, indices, split):
        _check_strings(batch, [text_column], indices, split)
        ids = [prefix + t + suffix if t else [] for t in encode(batch[text_column])]
        return {"input_ids": ids, "length": [len(x) for x in ids]}

    return fn


def prompt_completion_function(
    tokenizer,
    prompt_column: str = "prompt",
    completion_column: str = "completion",
    add_bos: bool | None = None,
    add_eos: bool = True,
):
    """The batched map function of prompt/completion text: ``{"prompt_ids", "completion_ids", "length"}``; the
    prompt carries the BOS, the completion the EOS (an empty completion stays empty)."""
    prefix, suffix = document_frame(tokenizer, add_bos, add_eos)
    encode = batch_encoder(tokenizer)

    def fn(batch, indices, split):
        _check_strings(batch, [prompt_column, completion_column], indices, split)
        prompts = [prefix + t for t in encode(batch[prompt_column])]
        completions = [t + suffix if t else [] for t in encode(batch[completion_column])]
        return {
            "prompt_ids": prompts,
            "completion_ids": completions,
            "length": [len(p) + len(c) for p, c in zip(prompts, completions)],
        }

    return fn


def pair_function(tokenizer, add_bos: bool | None = None, add_eos: bool = True):
    """The batched map function of text preference pairs: ``{"prompt_ids", "chosen_ids", "rejected_ids",
    "length"}``. A pair's two sequences share the prompt (framed once, like a prompt/completion prompt) and each
    completion ends with EOS, as TRL's DPO tokenization does."""
    prefix, suffix = document_frame(tokenizer, add_bos, add_eos)
    encode = batch_encoder(tokenizer)

    def fn(batch, indices, split):
        _check_strings(batch, PREFERENCE_TEXT, indices, split)
        prompt_column, *side_columns = PREFERENCE_TEXT
        prompts = [prefix + t for t in encode(batch[prompt_column])]
        sides = [[t + suffix if t else [] for t in encode(batch[name])] for name in side_columns]
        return {
            **dict(zip(PREFERENCE_IDS, [prompts, *sides])),
            "length": [len(p) + len(c) + len(r) for p, c, r in zip(prompts, *sides)],
        }

    return fn


def tokenize_dataset(dsd, tokenizer, kind, text_column: str = "text", num_proc: int | None = None):
    """Tokenize every split of ``dsd`` with ``datasets.map`` (batched, cached by fingerprint) with the map function
    of ``kind`` (a ``kinds`` object: ``encoder``, ``features``). Empty documents are kept (length 0) so that the
    DataModule can count them. ``token_cache.tokenize_cached`` does the same once per node, cached under a
    directory of ours."""
    import datasets

    fn = kind.encoder(tokenizer, text_column)
    return datasets.DatasetDict(
        {
            split: ds.map(
                fn,
                batched=True,
                with_indices=True,
                remove_columns=ds.column_names,
                num_proc=num_proc,
                fn_kwargs={"split": split},
                features=kind.features(),
                desc=f"Tokenizing {split}",
            )
            for split, ds in dsd.items()
        }
    )


def conversation_function(tokenizer, column: str, settings):
    """The batched map function of conversations (``conversations.encode_rows``, plus ``length``)."""
    from lightning_seqmem.data.chat_template import ChatRenderer
    from lightning_seqmem.data.conversations import ConversationSettings, encode_rows

    renderer = ChatRenderer(tokenizer)
    settings = settings or ConversationSettings()

    def fn(batch, indices, split):
        columns = encode_rows(batch[column], list(indices), renderer, settings)
        columns["length"] = [len(ids) for ids in columns["input_ids"]]
        return columns

    return fn


def chat_pair_function(tokenizer, settings):
    """The batched map function of conversation-form pairs (``chat_pairs.encode_chat_pairs``)."""
    from lightning_seqmem.data.chat_pairs import encode_chat_pairs
    from lightning_seqmem.data.chat_template import ChatRenderer

    renderer, encode = ChatRenderer(tokenizer, masks=False), batch_encoder(tokenizer)  # ids only: no offsets

    def fn(batch, indices, split):
        return encode_chat_pairs(batch, list(indices), renderer, settings, encode)

    return fn
