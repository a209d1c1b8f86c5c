"""Tokenizers: any Hugging Face tokenizer, or a small byte-level BPE trained offline on the built-in corpus.

The default exists so that the main job, the tests and CI never touch a model hub: it is trained with
``tokenizers`` on the built-in corpus's train split (deterministic), cached next to the corpus, and returned as a
``PreTrainedTokenizerFast`` with ``<s>``, ``</s>`` and ``<pad>`` set and the built-in ChatML-style chat template
(``chat_template.BUILTIN_CHAT_TEMPLATE``, with generation markers), so conversations work offline too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning_seqmem.data.cache_dir import build_folder, default_cache_dir
from lightning_seqmem.data.chat_template import BUILTIN_CHAT_TEMPLATE
from lightning_seqmem.data.corpus import corpus_path, load_builtin_corpus
from lightning_seqmem.messages import short_repr

DEFAULT_VOCAB_SIZE = 4096
TOKENIZER_PREFIX = "tokenizer-"  # the cache entry's name: <cache dir>/tokenizer-bpe<vocab size>-<corpus entry>
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def _default_path(vocab_size: int) -> Path:
    return default_cache_dir() / f"{TOKENIZER_PREFIX}bpe{vocab_size}-{corpus_path().name}"


def train_default_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Train (or load from cache) the default byte-level BPE tokenizer on the built-in corpus; it has the built-in
    chat template."""
    from transformers import PreTrainedTokenizerFast

    path = _default_path(vocab_size)
    if (path / "tokenizer.json").exists():
        return _with_chat_template(PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True))

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = load_builtin_corpus()["train"]["text"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1_000_000, **SPECIAL_TOKENS)
    with build_folder(path) as tmp:  # this writer's own folder, renamed into place whole; a faster one's is kept
        fast.save_pretrained(str(tmp))
    return _with_chat_template(PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True))


def _with_chat_template(tokenizer):
    """Set here, not saved with the files: tokenizers cached by earlier versions get it too."""
    tokenizer.chat_template = BUILTIN_CHAT_TEMPLATE
    return tokenizer


def tokenizer_name(tok: Any) -> str:
    """How messages name a tokenizer: its name or path where it has one, else its class and vocabulary size (a
    tokenizer built in memory has an empty ``name_or_path``)."""
    name = getattr(tok, "name_or_path", "")
    if name:
        return repr(str(name))
    size = len(tok) if hasattr(tok, "__len__") else None
    return f"{type(tok).__name__} (built in memory{f', {size:,} tokens' if size is not None else ''})"


def load_tokenizer(tokenizer: Any = None):
    """Resolve a tokenizer argument: ``None``/``"builtin"`` (the default BPE), a name or path, or an object.

    A tokenizer without a pad token gets its EOS token as pad token, with a warning.

    Raises:
        ValueError: the name or path cannot be loaded offline.
    """
    if tokenizer is None or tokenizer == "builtin":
        tok = train_default_tokenizer()
    elif isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        try:
            # Local files first: a name that is only on the hub must not silently trigger a download in CI.
            offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
            tok = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=offline or os.path.isdir(tokenizer))
        except Exception as err:  # transformers raises OSError, ValueError or hub errors depending on version
            raise ValueError(
                f"Could not load tokenizer {short_repr(str(tokenizer))}: {type(err).__name__}: {err}. "
                "Pass a local directory that holds tokenizer files (tokenizer.json or vocab files), a "
                "tokenizer object, or tokenizer=None for the built-in BPE tokenizer. On an offline machine, "
                "download it once elsewhere and point to the saved directory."
            ) from err
    elif hasattr(tokenizer, "convert_tokens_to_ids") and callable(tokenizer):
        tok = tokenizer
    else:
        raise TypeError(
            "tokenizer must be None, a name or path, or a Hugging Face tokenizer object; got "
            f"{type(tokenizer).__name__}."
        )
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ValueError(
                f"Tokenizer {tokenizer_name(tok)} has neither a pad nor an EOS token; add one "
                "with tokenizer.add_special_tokens({'pad_token': '<pad>'}) and resize the model's embeddings."
            )
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(
            f"Tokenizer {tokenizer_name(tok)} has no pad token; using its EOS token "
            f"{tok.eos_token!r} (id {tok.eos_token_id}) for padding. Padding never reaches the loss (labels -100)."
        )
        tok.pad_token = tok.eos_token
    return tok
