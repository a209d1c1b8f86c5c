"""The tokenizer of ``SeqMemDataModule`` and the ids the model takes from it (pad, EOS): the arguments first, the
tokenizer's own otherwise, loaded only when asked. No Lightning import."""

from __future__ import annotations

from typing import Any

from lightning_seqmem.data.tokenizer import load_tokenizer


class LazyTokenizer:
    """The DataModule's tokenizer, loaded on the first call, and what its read modes keep to ask for it.

    Why an object of its own: a read mode (and the loaders it makes) that asked the DataModule would hold it, while
    the DataModule holds the read mode. That cycle kept a dropped DataModule and its loader workers alive until the
    cyclic collector ran; in this repository's test processes that collection also stalled, 5 s per worker
    (``lightning_seqmem/_hparams.py`` says when and why).
    """

    def __init__(self, given: Any, pad_token_id: int | None):
        self.given = given  # None (the built-in one), a name or path, or a tokenizer object
        self.pad_token_id = pad_token_id
        self.pretokenized = False  # the data are token ids (known once their kind is)
        self.loaded = None

    def __call__(self):
        """The tokenizer; ``None`` for pre-tokenized data given with a ``pad_token_id`` and no tokenizer (the
        built-in one would not match them)."""
        if self.loaded is None:
            if self.given is None and self.pad_token_id is not None and self.pretokenized:
                return None
            self.loaded = load_tokenizer(self.given)
        return self.loaded


class TokenizerIds:
    """Mixed into ``SeqMemDataModule``: ``tokenizer``, ``pad_token_id`` and ``eos_token_id``."""

    settings: Any  # the DataModule's SeqMemSettings
    _lazy_tokenizer: LazyTokenizer

    @property
    def tokenizer(self):
        """The tokenizer, loaded on first access (``CausalLM`` reads the vocabulary size at setup); ``None`` for
        pre-tokenized data given with a ``pad_token_id`` and no tokenizer (the built-in one would not match)."""
        return self._lazy_tokenizer()

    @property
    def _tokenizer_arg(self) -> Any:
        """What was given as ``tokenizer`` (the planner builds DataModules of parts of the data with it)."""
        return self._lazy_tokenizer.given

    @property
    def _pretokenized(self) -> bool:
        """Whether the data are token ids (known once their kind is)."""
        return self._lazy_tokenizer.pretokenized

    @_pretokenized.setter
    def _pretokenized(self, value: bool) -> None:
        self._lazy_tokenizer.pretokenized = value

    @property
    def pad_token_id(self) -> int:
        """The pad id: the ``pad_token_id`` argument, else the tokenizer's."""
        if self.settings.data.pad_token_id is not None:
            return self.settings.data.pad_token_id
        return int(self.tokenizer.pad_token_id)

    @property
    def eos_token_id(self) -> int | None:
        """The EOS id: the ``eos_token_id`` argument, else the tokenizer's (pre-tokenized rows are used as given,
        so this is for the model's config and generation, not added to rows)."""
        if self.settings.data.eos_token_id is not None:
            return self.settings.data.eos_token_id
        return None if self.tokenizer is None else self.tokenizer.eos_token_id
