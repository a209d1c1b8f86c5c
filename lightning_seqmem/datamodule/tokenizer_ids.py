"""The tokenizer of ``SeqMemDataModule`` and the ids the model takes from it (pad, EOS): the arguments first, the
tokenizer's own otherwise, loaded only when asked. No Lightning import."""

from __future__ import annotations

from typing import Any

from lightning_seqmem.data.tokenizer import load_tokenizer


class TokenizerIds:
    """Mixed into ``SeqMemDataModule``: ``tokenizer``, ``pad_token_id`` and ``eos_token_id``."""

    settings: Any  # the DataModule's SeqMemSettings
    _tokenizer: Any  # the loaded tokenizer, or None until asked
    _tokenizer_arg: Any  # what was given: None (the built-in one), a name or path, or an object
    _pretokenized: bool  # the data are token ids (known once their kind is)

    @property
    def tokenizer(self):
        """The tokenizer, loaded on first access (``CausalLM`` reads the vocabulary size at setup); ``None`` for
        pre-tokenized data given with a ``pad_token_id`` and no tokenizer (the built-in one would not match)."""
        if self._tokenizer is None:
            if self._tokenizer_arg is None and self.settings.data.pad_token_id is not None and self._pretokenized:
                return None
            self._tokenizer = load_tokenizer(self._tokenizer_arg)
        return self._tokenizer

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
