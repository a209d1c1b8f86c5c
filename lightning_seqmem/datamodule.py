"""``SeqMemDataModule``: text in, padded / truncated / packed batches out, with every lost token counted.

The work happens in the pure modules (``data_source``, ``truncation``, ``packing``, ``collate``, ``sampling``);
this class only wires them to Lightning's ``prepare_data``/``setup``/``*_dataloader`` hooks.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch.distributed as dist
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from lightning_seqmem.collate import PackCollator, PadCollator, TruncateCollator
from lightning_seqmem.data_source import (
    check_columns,
    document_frame,
    ensure_validation_split,
    load_text_dataset,
    tokenize_dataset,
)
from lightning_seqmem.packing import PackResult, StreamingPacker, check_packing, pack_sequences
from lightning_seqmem.sampling import (
    BatchFetcher,
    LengthGroupedSampler,
    ShuffledBatchSampler,
    TokenBudgetBatchSampler,
)
from lightning_seqmem.tokenizer import load_tokenizer
from lightning_seqmem.truncation import (
    PromptCompletionLimits,
    check_truncation_side,
    count_truncated,
    prompt_completion_example,
)

try:  # exact mid-epoch resume through Lightning checkpoints when torchdata is installed
    from torchdata.stateful_dataloader import StatefulDataLoader as _Loader
except ImportError:  # pragma: no cover - the samplers still resume through their own state_dict
    _Loader = DataLoader

STRATEGIES = ("pad", "truncate", "pack")
PAD_KEYS = ("input_ids", "attention_mask", "labels")
PACK_KEYS = ("input_ids", "labels", "position_ids")


class _PackedRows(Dataset):
    """Row ``i`` of a ``PackResult`` as ``{"input_ids", "seq_lengths"[, "labels"]}`` (what ``PackCollator`` takes)."""

    def __init__(self, packed: PackResult, labels: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        self.packed, self.labels = packed, labels

    def __len__(self) -> int:
        return self.packed.num_rows

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.packed.row(i, self.labels)


class _StreamingRows(IterableDataset):
    """A text stream tokenized and packed on the fly; rank ``r`` and worker ``w`` take every n-th document.

    Memory is bounded by the packer's window. With ``cycle`` the stream restarts when it ends, so DDP ranks
    (whose shares differ in length) never wait on each other; stop training with ``max_steps``.
    """

    def __init__(self, stream, encode, packer: StreamingPacker, rank: int, world: int, cycle: bool) -> None:
        self.stream, self.encode, self.packer = stream, encode, packer
        self.rank, self.world, self.cycle = rank, world, cycle

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        shard, shards = self.rank * workers + worker, self.world * workers
        while True:
            mine = (self.encode(i, ex) for i, ex in enumerate(self.stream) if i % shards == shard)
            yield from self.packer(mine)
            if not self.cycle:
                return


class SeqMemDataModule(LightningDataModule):
    """Variable-length text for causal-LM training.

    Args:
        dataset: ``"builtin"`` (the standard-library corpus), a ``datasets.Dataset``/``DatasetDict``, local
            json/jsonl/parquet/txt/csv files (path, glob or list), a ``save_to_disk`` directory, or a hub name.
            A ``text`` column, or ``prompt`` and ``completion`` columns.
        tokenizer: ``None`` for the built-in BPE tokenizer, a name or local path for ``AutoTokenizer``, or a
            tokenizer object.
        max_length: longest row fed to the model, in tokens.
        micro_batch_size: rows per training batch on each device (before gradient accumulation).
        eval_batch_size: rows per validation batch; defaults to ``micro_batch_size`` (same memory profile).
        strategy: ``"pad"`` (pad each batch to its longest row), ``"truncate"`` (every row cut and padded to
            ``max_length``) or ``"pack"`` (documents packed into ``max_length`` rows, no padding between them).
        pad_to_multiple_of: padded length rounded up to this (8 suits tensor cores); ``None`` to disable.
        text_column: the column holding the text.
        num_workers: DataLoader worker processes.
        seed: seeds shuffling and the validation split; epoch ``e`` uses ``seed + e`` on every rank.
        packing: ``"bfd"`` (best-fit decreasing over the whole split) or ``"wrapped"`` (concatenate, cut).
        overflow: ``pack``/``bfd`` with a document longer than ``max_length``: ``"split"`` (pieces, nothing lost),
            ``"truncate"``, ``"drop"`` or ``"error"``.
        group_by_length: ``pad`` only: batches of similar lengths (mega-batches), the longest batch first.
        pad_to_max_length: ``pad`` only: always ``[rows, max_length]`` so the CUDA allocator reuses its blocks.
        max_tokens_per_batch: token budget (rows x padded length) per batch; ``pad`` gets a variable number of
            rows, ``truncate``/``pack`` get ``max_tokens_per_batch // max_length`` rows.
        truncation_side: ``"right"`` keeps the start of a long document, ``"left"`` its end.
        max_prompt_length: prompt/completion data: keep the last ``max_prompt_length`` prompt tokens.
        max_completion_length: prompt/completion data: keep the first ``max_completion_length`` completion tokens.
        completion_only_loss: prompt/completion data: labels -100 on the prompt.
        return_cu_seqlens: ``pack`` only: also yield ``cu_seqlens`` for custom varlen attention.
        drop_last: drop the incomplete tail of an epoch (counted in ``stats()``) instead of smaller last batches.
        streaming_buffer_size: streaming datasets (``datasets.IterableDataset``, ``strategy="pack"`` only):
            documents held in the best-fit window; memory does not grow with the dataset.
        streaming_validation_documents: a stream without a ``validation`` split gives its first this many
            documents to validation (and training skips them).

    Example::

        dm = SeqMemDataModule(max_length=512, micro_batch_size=8, strategy="pack")
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
        packing: str = "bfd",
        overflow: str = "split",
        group_by_length: bool = False,
        pad_to_max_length: bool = False,
        max_tokens_per_batch: int | None = None,
        truncation_side: str = "right",
        max_prompt_length: int | None = None,
        max_completion_length: int | None = None,
        completion_only_loss: bool = True,
        return_cu_seqlens: bool = False,
        drop_last: bool = False,
        streaming_buffer_size: int = 1000,
        streaming_validation_documents: int = 100,
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
        check_packing(packing, overflow)
        check_truncation_side(truncation_side)
        self._limits = PromptCompletionLimits(max_length, max_prompt_length, max_completion_length, truncation_side)
        if max_tokens_per_batch is not None and strategy != "pad" and max_tokens_per_batch < max_length:
            raise ValueError(
                f"max_tokens_per_batch={max_tokens_per_batch} is smaller than one row of max_length={max_length} "
                f"tokens (strategy={strategy!r} rows are always max_length long); set it to at least {max_length}."
            )
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
        self.packing = packing
        self.overflow = overflow
        self.group_by_length = group_by_length
        self.pad_to_max_length = pad_to_max_length
        self.max_tokens_per_batch = max_tokens_per_batch
        self.truncation_side = truncation_side
        self.completion_only_loss = completion_only_loss
        self.return_cu_seqlens = return_cu_seqlens
        self.drop_last = drop_last
        self.streaming_buffer_size = streaming_buffer_size
        self.streaming_validation_documents = streaming_validation_documents
        self.streaming = False
        self._tokenizer_arg = tokenizer
        self._tokenizer = None
        self.datasets: dict[str, Any] | None = None
        self._rows: dict[str, Dataset] = {}
        self._lengths: dict[str, np.ndarray] = {}  # per row fed to the model, after truncation
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
        import datasets

        if isinstance(self.dataset, (datasets.IterableDataset, datasets.IterableDatasetDict)):
            return self._setup_streaming()
        raw = load_text_dataset(self.dataset)
        kind = check_columns(raw, self.text_column)
        # Tokenize before carving out a validation split, so errors name rows of the dataset the user passed.
        tokenized = tokenize_dataset(raw, self.tokenizer, kind=kind, text_column=self.text_column)
        tokenized = ensure_validation_split(tokenized, seed=self.seed)
        self.datasets = {}
        for split in ("train", "validation"):
            self._setup_split(split, tokenized[split], kind)
        for split in self._stats:
            self._stats[split].update(self._loader_stats(split))

    def _setup_split(self, split: str, ds, kind: str) -> None:
        """Skip empty documents, truncate or pack, and count every token that will not reach the model."""
        lengths = ds["length"]
        lengths = lengths.to_pylist() if hasattr(lengths, "to_pylist") else list(lengths)
        keep = [i for i, n in enumerate(lengths) if n > 0]
        empty = len(lengths) - len(keep)
        if empty:
            ds = ds.select(keep)
            lengths = [lengths[i] for i in keep]
        if split == "train" and len(ds) == 0:
            raise ValueError("Every training document is empty after tokenization: there is nothing to train on.")
        stats = {
            "documents": len(lengths), "empty_documents_skipped": empty, "tokens": sum(lengths),
            "tokens_truncated": 0, "tokens_dropped": 0, "documents_split": 0,
            "documents_over_max_length": sum(1 for n in lengths if n > self.max_length),
            "longest_document": max(lengths, default=0),
        }
        if kind == "prompt_completion":
            ds, stats = self._prompt_completion_rows(ds, stats, split)
        else:
            ds = ds.select_columns(["input_ids"])
        self.datasets[split] = ds
        self._stats[split] = stats
        if self.strategy == "pack":
            self._pack_split(split)
        else:
            self._rows[split] = ds
            if kind == "text":
                stats["tokens_truncated"] = count_truncated(lengths, self.max_length)
                self._lengths[split] = np.minimum(np.asarray(lengths, dtype=np.int64), self.max_length)
        self._report(split, stats)

    def _setup_streaming(self) -> None:
        if self.strategy != "pack":
            raise ValueError(
                f"A streaming dataset is packed on the fly: use strategy='pack' (strategy={self.strategy!r} needs the "
                "whole dataset), or load it without streaming=True."
            )
        ds = self.dataset
        train, val = (ds["train"], ds.get("validation")) if isinstance(ds, dict) else (ds, None)
        if val is None:
            n = self.streaming_validation_documents
            train, val = train.skip(n), train.take(n)
        self.streaming = True
        self.datasets = {"train": train, "validation": val}
        self._stats = {split: {"streaming": True, "buffer_size": self.streaming_buffer_size} for split in self.datasets}

    def _encode(self, index: int, example: dict) -> list[int]:
        """One streamed document to ``[bos] + tokens + [eos]``, as ``data_source`` does for map-style data."""
        text = example.get(self.text_column)
        if not isinstance(text, str):
            raise TypeError(
                f"Row {index} of the stream: column {self.text_column!r} is {type(text).__name__}, not a string. "
                "Filter the stream (stream.filter(...)) or pass text_column=<name>."
            )
        if not text:
            return []  # skipped by the packer
        prefix, suffix = document_frame(self.tokenizer)
        return prefix + self.tokenizer(text, add_special_tokens=False)["input_ids"] + suffix

    def _streaming_loader(self, split: str) -> DataLoader:
        initialised = dist.is_available() and dist.is_initialized()
        world, rank = (dist.get_world_size(), dist.get_rank()) if initialised else (1, 0)
        if world > 1 and split == "train":
            rank_zero_warn("Streaming under DDP: the train stream repeats so no rank runs out first; set max_steps.")
        packer = StreamingPacker(self.max_length, self.streaming_buffer_size, self.overflow)
        cycle = world > 1 and split == "train"
        rows = _StreamingRows(self.datasets[split], self._encode, packer, rank, world, cycle=cycle)
        return DataLoader(rows, batch_size=self._rows_per_batch(split), collate_fn=self._collator(),
                          num_workers=self.num_workers)

    def _prompt_completion_rows(self, ds, stats: dict, split: str):
        """Truncate prompt/completion pairs once, at dataset level, so every cut token is counted exactly."""
        rows, truncated, emptied = [], 0, 0
        limits = self._limits
        if self.strategy == "pack":  # packing keeps long rows (overflow decides): only the per-part limits apply
            limits = PromptCompletionLimits(None, limits.max_prompt_length, limits.max_completion_length)
        for p, c in zip(ds["prompt_ids"], ds["completion_ids"]):
            ex = prompt_completion_example(p, c, limits, self.completion_only_loss)
            truncated += ex["num_truncated"]
            if ex["completion_length"] == 0:
                emptied += 1  # nothing to learn from: reported below, never trained on silently
                truncated += len(ex["input_ids"])
                continue
            rows.append({"input_ids": ex["input_ids"], "labels": ex["labels"]})
        import datasets

        columns = {"input_ids": [r["input_ids"] for r in rows], "labels": [r["labels"] for r in rows]}
        self._lengths[split] = np.asarray([len(r) for r in columns["input_ids"]], dtype=np.int64)
        stats.update(tokens_truncated=truncated, rows_without_completion=emptied)
        if emptied:
            rank_zero_warn(
                f"{split}: {emptied} prompt/completion rows have no completion left after truncation and are "
                "skipped. Lower max_prompt_length or raise max_length to keep them."
            )
        return datasets.Dataset.from_dict(columns), stats

    def _pack_split(self, split: str) -> None:
        """Pack the whole split once; epochs reshuffle the packed rows, they never re-pack."""
        # Tokenized documents already end with EOS, so ``wrapped`` needs no extra separator.
        ds = self.datasets[split]
        packed = pack_sequences(list(ds["input_ids"]), self.max_length, self.packing, self.overflow)
        labels = None
        if "labels" in ds.column_names:  # prompt/completion: labels follow their tokens into the same slots
            labels = (np.fromiter(itertools.chain.from_iterable(ds["labels"]), dtype=np.int64), packed.source[1])
        self._rows[split] = _PackedRows(packed, labels)
        self._lengths[split] = np.diff(packed.row_offsets)
        s = packed.stats()
        stats = self._stats[split]
        stats["tokens_truncated"] += s["tokens_truncated"]  # adds to any prompt/completion truncation
        stats.update(tokens_dropped=s["tokens_dropped"], documents_split=s["documents_split"])

    def _report(self, split: str, stats: dict) -> None:
        truncated, dropped = stats["tokens_truncated"], stats["tokens_dropped"]
        if truncated + dropped:
            if self.strategy != "pack":
                fix = "Raise max_length, or use strategy='pack' (overflow='split') to keep them."
            elif self.overflow != "split":
                fix = "Use overflow='split' to keep them (a long document becomes max_length pieces)."
            else:
                fix = "Raise max_prompt_length / max_completion_length to keep them."
            rank_zero_warn(
                f"{split}: {stats['documents_over_max_length']} documents are longer than max_length={self.max_length}; "
                f"with strategy={self.strategy!r}, {truncated + dropped:,} of {stats['tokens']:,} tokens "
                f"({100 * (truncated + dropped) / max(stats['tokens'], 1):.2f}%) never reach the model "
                f"({truncated:,} truncated, {dropped:,} dropped). {fix}"
            )
        if stats["empty_documents_skipped"]:
            rank_zero_info(f"[lightning_seqmem] {split}: skipped {stats['empty_documents_skipped']} empty documents.")

    # ------------------------------------------------------------------------------------------------ loaders
    def _collator(self):
        if self.strategy == "pack":
            return PackCollator(self.pad_token_id, self.max_length, return_cu_seqlens=self.return_cu_seqlens)
        if self.strategy == "truncate":
            return TruncateCollator(self.pad_token_id, self.max_length, truncation_side=self.truncation_side)
        return PadCollator(
            self.pad_token_id, max_length=self.max_length, pad_to_multiple_of=self.pad_to_multiple_of,
            pad_to_max_length=self.pad_to_max_length, truncation_side=self.truncation_side,
        )

    def _rows_per_batch(self, split: str) -> int:
        if self.max_tokens_per_batch is not None:  # constant-shape strategies: the budget fixes the rows
            return self.max_tokens_per_batch // self.max_length
        return self.micro_batch_size if split == "train" else self.eval_batch_size

    def _sampler(self, split: str, num_replicas: int | None = None, rank: int | None = None):
        """This rank's batch sampler for ``split`` (train shuffles with ``seed + epoch``)."""
        shuffle = split == "train"
        common = dict(shuffle=shuffle, seed=self.seed, num_replicas=num_replicas, rank=rank,
                      drop_last=self.drop_last and shuffle)
        n = len(self._rows[split])
        if self.strategy == "pad" and self.max_tokens_per_batch is not None:
            return TokenBudgetBatchSampler(self._lengths[split], self.max_tokens_per_batch,
                                           padded_length=self._collator().padded_length, **common)
        if self.strategy == "pad" and self.group_by_length:
            return LengthGroupedSampler(self._lengths[split], self._rows_per_batch(split), **common)
        return ShuffledBatchSampler(n, self._rows_per_batch(split), **common)

    def _loader(self, split: str) -> DataLoader:
        if self.datasets is None:
            self.setup("fit")
        if self.streaming:
            return self._streaming_loader(split)
        return _Loader(
            BatchFetcher(self._rows[split]), sampler=self._sampler(split), batch_size=None,
            collate_fn=self._collator(), num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation")

    # ---------------------------------------------------------------------------------------------- reporting
    def batch_keys(self) -> tuple[str, ...]:
        """The keys of the batches the train loader yields."""
        if self.strategy == "pack":
            return PACK_KEYS + (("cu_seqlens",) if self.return_cu_seqlens else ())
        return PAD_KEYS

    def _shapes(self, split: str) -> list[tuple[int, int]]:
        """``(rows, length)`` of every batch of ``split`` in epoch 0, on a single process."""
        sampler = self._sampler(split, num_replicas=1, rank=0)
        lengths = self._lengths[split]
        if self.strategy == "pad":
            collator = self._collator()
            return [(len(b), collator.padded_length(int(lengths[b].max()))) for b in sampler.batches(0)]
        return [(len(b), self.max_length) for b in sampler.batches(0)]

    def max_batch_shape(self) -> tuple[int, int]:
        """The largest ``(rows, length)`` any loader yields (for pre-allocation).

        With a token budget, rows and length vary together: this is the shape of the batch with the most slots.
        """
        if self.datasets is None:
            self.setup("fit")
        if self.streaming:
            return max(self._rows_per_batch("train"), self._rows_per_batch("validation")), self.max_length
        shapes = [s for split in self._rows for s in self._shapes(split)]
        if self.strategy == "pad" and self.max_tokens_per_batch is not None:
            return max(shapes, key=lambda s: (s[0] * s[1], s[1]))
        return max(s[0] for s in shapes), max(s[1] for s in shapes)

    def _loader_stats(self, split: str) -> dict[str, float]:
        """One epoch on one process: batches, rows ``drop_last`` leaves out, real tokens / slots."""
        sampler = self._sampler(split, num_replicas=1, rank=0)
        shapes = self._shapes(split)
        fed = sum(int(self._lengths[split][b].sum()) for b in sampler.batches(0))
        return {"rows": len(self._rows[split]), "batches": len(shapes), "rows_dropped_per_epoch": sampler.num_dropped,
                "token_efficiency": fed / max(sum(r * n for r, n in shapes), 1)}

    def stats(self) -> dict[str, Any]:
        """Per split: documents, tokens, tokens truncated/dropped, documents split, empty documents skipped,
        rows, batches, rows ``drop_last`` leaves out, and token efficiency (real tokens / slots in one epoch)."""
        if self.datasets is None:
            self.setup("fit")
        return {split: dict(values) for split, values in self._stats.items()}
