"""``SeqMemDataModule``: text in, padded / truncated / packed batches out, with every lost token counted.

The work happens in the pure modules (``data_source``, ``truncation``, ``packing``, ``collate``, ``sampling``);
this class only wires them to Lightning's ``prepare_data``/``setup``/``*_dataloader`` hooks.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from lightning_seqmem.collate import PadCollator
from lightning_seqmem.data_source import check_columns, ensure_validation_split, load_text_dataset, tokenize_dataset
from lightning_seqmem.tokenizer import load_tokenizer
from lightning_seqmem.truncation import count_truncated

STRATEGIES = ("pad",)


class SeqMemDataModule(LightningDataModule):
    """Variable-length text for causal-LM training.

    Args:
        dataset: ``"builtin"`` (the standard-library corpus), a ``datasets.Dataset``/``DatasetDict``, local
            json/jsonl/parquet/txt/csv files (path, glob or list), a ``save_to_disk`` directory, or a hub name.
        tokenizer: ``None`` for the built-in BPE tokenizer, a name or local path for ``AutoTokenizer``, or a
            tokenizer object.
        max_length: longest row fed to the model, in tokens.
        micro_batch_size: rows per training batch on each device (before gradient accumulation).
        eval_batch_size: rows per validation batch; defaults to ``micro_batch_size`` (same memory profile).
        strategy: ``"pad"``.
        pad_to_multiple_of: padded length rounded up to this (8 suits tensor cores); ``None`` to disable.
        text_column: the column holding the text.
        num_workers: DataLoader worker processes.
        seed: seeds shuffling and the validation split.

    Example::

        dm = SeqMemDataModule(max_length=512, micro_batch_size=8)
        trainer.fit(CausalLM(), datamodule=dm)
        print(dm.stats())
    """

    def __init__(
        self,
        dataset: Any = "builtin",
        tokenizer: Any = None,
        max_length: int = 512,
        micro_batch_size: int = 8,
        eval_batch_size: int | None = None,
        strategy: str = "pad",
        pad_to_multiple_of: int | None = 8,
        text_column: str = "text",
        num_workers: int = 0,
        seed: int = 42,
    ) -> None:
        super().__init__()
        if not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"max_length must be an int >= 2 (a row needs an input and a target), got {max_length!r}.")
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be an int >= 1, got {micro_batch_size!r}.")
        if eval_batch_size is not None and (not isinstance(eval_batch_size, int) or eval_batch_size < 1):
            raise ValueError(f"eval_batch_size must be an int >= 1 or None (= micro_batch_size), got {eval_batch_size!r}.")
        if strategy not in STRATEGIES:
            raise ValueError(f"Unknown strategy {strategy!r}; choose one of {list(STRATEGIES)}.")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}.")
        self.save_hyperparameters(ignore=["dataset", "tokenizer"])
        self.dataset = dataset
        self.max_length = max_length
        self.micro_batch_size = micro_batch_size
        self.eval_batch_size = eval_batch_size or micro_batch_size
        self.strategy = strategy
        self.pad_to_multiple_of = pad_to_multiple_of
        self.text_column = text_column
        self.num_workers = num_workers
        self.seed = seed
        self._tokenizer_arg = tokenizer
        self._tokenizer = None
        self.datasets: dict[str, Any] | None = None
        self._stats: dict[str, dict[str, float]] = {}

    # --------------------------------------------------------------------------------------------- resources
    @property
    def tokenizer(self):
        """The tokenizer, loaded on first access (so ``CausalLM`` can read the vocabulary size at setup)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self._tokenizer_arg)
        return self._tokenizer

    @property
    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    def prepare_data(self) -> None:
        """Build (once, on one process) what is cached on disk: the built-in corpus and the default tokenizer."""
        if isinstance(self.dataset, str) and self.dataset == "builtin":
            from lightning_seqmem.corpus import load_builtin_corpus

            load_builtin_corpus()
        _ = self.tokenizer

    def setup(self, stage: str | None = None) -> None:
        if self.datasets is not None:
            return
        raw = load_text_dataset(self.dataset)
        kind = check_columns(raw, self.text_column)
        # Tokenize before carving out a validation split, so that errors name rows of the user's own splits.
        tokenized = tokenize_dataset(raw, self.tokenizer, kind=kind, text_column=self.text_column)
        tokenized = ensure_validation_split(tokenized, seed=self.seed)
        self.datasets = {}
        for split in ("train", "validation"):
            ds = tokenized[split]
            lengths = ds["length"]
            lengths = lengths.to_pylist() if hasattr(lengths, "to_pylist") else list(lengths)
            keep = [i for i, n in enumerate(lengths) if n > 0]
            empty = len(lengths) - len(keep)
            if empty:
                ds = ds.select(keep)
                lengths = [lengths[i] for i in keep]
            if split == "train" and len(ds) == 0:
                raise ValueError("Every training document is empty after tokenization: there is nothing to train on.")
            self.datasets[split] = ds.select_columns(["input_ids"])
            truncated = count_truncated(lengths, self.max_length)
            tokens = sum(lengths)
            self._stats[split] = {
                "documents": len(lengths), "empty_documents_skipped": empty, "tokens": tokens,
                "tokens_truncated": truncated,
                "documents_truncated": sum(1 for n in lengths if n > self.max_length),
                "longest_document": max(lengths, default=0),
            }
            if truncated:
                rank_zero_warn(
                    f"{split}: {self._stats[split]['documents_truncated']} documents are longer than "
                    f"max_length={self.max_length}; strategy='pad' cuts them, losing {truncated:,} of {tokens:,} "
                    f"tokens ({100 * truncated / max(tokens, 1):.2f}%). Raise max_length, or use strategy='pack' "
                    "to keep them."
                )
            if empty:
                rank_zero_info(f"[lightning_seqmem] {split}: skipped {empty} empty documents.")

    # ------------------------------------------------------------------------------------------------ loaders
    def _collator(self) -> PadCollator:
        return PadCollator(self.pad_token_id, max_length=self.max_length, pad_to_multiple_of=self.pad_to_multiple_of)

    def _loader(self, split: str, batch_size: int, shuffle: bool) -> DataLoader:
        if self.datasets is None:
            self.setup("fit")
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            self.datasets[split], batch_size=batch_size, shuffle=shuffle, collate_fn=self._collator(),
            num_workers=self.num_workers, generator=generator, persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", self.micro_batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation", self.eval_batch_size, shuffle=False)

    # ---------------------------------------------------------------------------------------------- reporting
    def batch_keys(self) -> tuple[str, ...]:
        """The keys of the batches the train loader yields."""
        return ("input_ids", "attention_mask", "labels")

    def max_batch_shape(self) -> tuple[int, int]:
        """The largest ``(rows, length)`` any loader yields (for pre-allocation)."""
        if self.datasets is None:
            self.setup("fit")
        longest = max(s["longest_document"] for s in self._stats.values())
        length = self._collator().padded_length(min(longest, self.max_length))
        return max(self.micro_batch_size, self.eval_batch_size), length

    def stats(self) -> dict[str, Any]:
        """Per split: documents, tokens, tokens truncated, empty documents skipped, longest document."""
        if self.datasets is None:
            self.setup("fit")
        return {split: dict(values) for split, values in self._stats.items()}


# FOUNDATION-DONE (the lead's first version; helper-owned from here on)
