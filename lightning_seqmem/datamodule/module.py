"""``SeqMemDataModule``: text in, padded / truncated / packed batches out, with every lost token counted.

The work happens in the pure modules (``data``, ``batching``);
this class only wires them to Lightning's ``prepare_data``/``setup``/``*_dataloader`` hooks.
"""

from __future__ import annotations

import numbers
import os
from typing import Any

import numpy as np
import torch.distributed as dist
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from typing_extensions import override

from lightning_seqmem.data.columns import check_columns
from lightning_seqmem.data.encode import document_frame
from lightning_seqmem.data.sources import ensure_validation_split, load_text_dataset, select_rows
from lightning_seqmem.messages import short_repr
from lightning_seqmem.batching import OVERFLOWS, StreamingPacker, check_packing
from lightning_seqmem.batching.sampling import BatchFetcher
from lightning_seqmem.batch import IGNORE_INDEX
from lightning_seqmem.batching.strategies import (  # noqa: F401  (STRATEGIES: public name)
    STRATEGIES,
    BatchingOptions,
    PackedRows,
    largest_shape,
    make_strategy,
)
from lightning_seqmem.data.token_cache import default_cache_dir
from lightning_seqmem.data.tokenizer import load_tokenizer
from lightning_seqmem.data.tokens import ConcatView, ConstantView, view_of_dataset
from lightning_seqmem.batching.truncation import PromptCompletionLimits, check_truncation_side, prompt_completion_spans

try:  # exact mid-epoch resume through Lightning checkpoints when torchdata is installed
    from torchdata.stateful_dataloader import StatefulDataLoader as _Loader
except ImportError:  # pragma: no cover - the samplers still resume through their own state_dict
    _Loader = DataLoader

_PackedRows = PackedRows  # the old private name

RESUME_MISMATCH = ("error", "restart_epoch")


class _ResumableLoader(_Loader):
    """The map-style loader; ``skip_resume_state`` makes it start its epoch afresh instead of loading a saved
    position (set when the checkpoint's data differ from this run's: the old position would point at other rows)."""

    skip_resume_state = False

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self.skip_resume_state and hasattr(_Loader, "load_state_dict"):
            super().load_state_dict(state_dict)


def _integer(name: str, value: Any, minimum: int, hint: str = "", optional: bool = False) -> int | None:
    """Any integral number (``int``, ``np.int64``, ...) as an ``int >= minimum``; else a ``ValueError``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{hint}, got {short_repr(value)}.")
    return int(value)


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

    Map-style data lives in the Arrow tables ``datasets`` keeps memory-mapped: tokens are read as numpy views,
    rows are planned from lengths and gathered when served, so memory grows with documents, not tokens.
    Tokenization runs once per node (``prepare_data``) and is cached under ``cache_dir``.

    Args:
        dataset: ``"builtin"`` (the standard-library corpus), a ``datasets.Dataset``/``DatasetDict``, local
            json/jsonl/parquet/txt/csv files (path, glob or list), a ``save_to_disk`` directory, or a hub name.
            A ``text`` column, or ``prompt`` and ``completion`` columns; or pre-tokenized: ``input_ids``
            (optionally ``labels``), or ``prompt_ids`` and ``completion_ids``, used as they are.
        tokenizer: ``None`` for the built-in BPE tokenizer, a name or local path for ``AutoTokenizer``, or a
            tokenizer object.
        max_length: longest row fed to the model, in tokens.
        micro_batch_size: rows per training batch on each device (before gradient accumulation).
        eval_batch_size: rows per validation batch; defaults to ``micro_batch_size`` (same memory profile).
        strategy: ``"pad"`` (pad each batch to its longest row), ``"truncate"`` (every row cut and padded to
            ``max_length``) or ``"pack"`` (documents packed into ``max_length`` rows, no padding between them).
        eval_strategy: the strategy of the validation loader; ``None`` (default) is the training strategy. E.g.
            ``strategy="pack", eval_strategy="pad"`` trains packed and validates one document per row.
        pad_to_multiple_of: padded length rounded up to this (8 suits tensor cores); ``None`` to disable.
        text_column: the column holding the text.
        num_workers: DataLoader worker processes.
        seed: seeds shuffling and the validation split; epoch ``e`` uses ``seed + e`` on every rank.
        packing: ``"bfd"`` (best-fit decreasing over the whole split) or ``"wrapped"`` (concatenate, cut).
        overflow: ``pack`` with a row longer than ``max_length``: ``"split"`` (pieces, nothing lost),
            ``"truncate"``, ``"drop"`` or ``"error"``. ``None`` (default): ``"split"`` for plain text,
            ``"truncate"`` for prompt/completion rows (the prompt/completion limits below, with ``max_length``:
            a piece of an SFT example without its prompt would train on an answer to nothing).
        allow_split_prompt_completion: with ``overflow="split"``, also split prompt/completion rows (later
            pieces then lose their prompt); refused without this explicit opt-in.
        group_by_length: ``pad`` only: batches of similar lengths (mega-batches), the longest batch first.
        pad_to_max_length: ``pad`` only: always ``[rows, max_length]`` so the CUDA allocator reuses its blocks.
        max_tokens_per_batch: token budget (rows x padded length) per batch; ``pad`` gets a variable number of
            rows, ``truncate``/``pack`` get ``max_tokens_per_batch // max_length`` rows.
        truncation_side: ``"right"`` keeps the start of a long document, ``"left"`` its end. Prompt/completion
            rows over ``max_length``: ``"right"`` cuts the completion's end first, ``"left"`` the prompt's start.
        max_prompt_length: prompt/completion data: keep the last ``max_prompt_length`` prompt tokens.
        max_completion_length: prompt/completion data: keep the first ``max_completion_length`` completion tokens.
        completion_only_loss: prompt/completion data: labels -100 on the prompt.
        return_cu_seqlens: ``pack`` only: also yield ``cu_seqlens`` for custom varlen attention.
        drop_last: drop the incomplete tail of an epoch (counted in ``stats()``) instead of smaller last batches.
        streaming_buffer_size: streaming datasets (``datasets.IterableDataset``, ``strategy="pack"`` only):
            documents held in the best-fit window; memory does not grow with the dataset.
        streaming_validation_documents: a stream without a ``validation`` split gives its first this many
            documents to validation (and training skips them).
        num_proc: processes for tokenization; ``None``: 1 for small datasets, else ``min(8, cpus // 2)``.
        cache_dir: where tokenized datasets are cached (keyed by the data, the tokenizer's content and the
            framing); ``None``: ``$XDG_CACHE_HOME/lightning_seqmem`` (or ``~/.cache/lightning_seqmem``).
        pad_token_id, eos_token_id: pre-tokenized data: the special ids, when no tokenizer gives them (with
            ``pad_token_id`` given, the data path never loads a tokenizer); ``dm.pad_token_id``/``dm.eos_token_id``.
        on_resume_mismatch: a checkpoint whose data position was saved with other rows (another ``max_length``,
            strategy, dataset, batch size or seed): ``"error"`` (default) refuses to resume and names what
            changed; ``"restart_epoch"`` keeps the checkpoint's model and optimizer but starts the current epoch
            from its first batch.

    Example::

        dm = SeqMemDataModule(max_length=512, micro_batch_size=8, strategy="pack")
        trainer.fit(CausalLM(), datamodule=dm)
        print(dm.stats())
    """

    _pretokenized = False  # set when the dataset already holds token ids
    _documents = None  # (tokenized DatasetDict, kind), once per process
    _skip_resume_state = False  # set by load_state_dict when the checkpoint's data differ (restart_epoch)

    def __init__(
        self,
        dataset: Any = "builtin",
        tokenizer: Any = None,
        max_length: int = 512,
        micro_batch_size: int = 8,
        eval_batch_size: int | None = None,
        strategy: str = "pad",
        eval_strategy: str | None = None,
        pad_to_multiple_of: int | None = 8,
        text_column: str = "text",
        num_workers: int = 0,
        seed: int = 42,
        packing: str = "bfd",
        overflow: str | None = None,
        allow_split_prompt_completion: bool = False,
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
        num_proc: int | None = None,
        cache_dir: str | os.PathLike | None = None,
        pad_token_id: int | None = None,
        eos_token_id: int | None = None,
        on_resume_mismatch: str = "error",
    ) -> None:
        super().__init__()
        max_length = _integer("max_length", max_length, 2, " (a row needs an input and a target)")
        micro_batch_size = _integer("micro_batch_size", micro_batch_size, 1)
        eval_batch_size = _integer("eval_batch_size", eval_batch_size, 1, " or None (= micro_batch_size)", True)
        num_workers = _integer("num_workers", num_workers, 0)
        seed = _integer("seed", seed, 0)
        pad_to_multiple_of = _integer("pad_to_multiple_of", pad_to_multiple_of, 1, " or None", True)
        max_tokens_per_batch = _integer("max_tokens_per_batch", max_tokens_per_batch, 1, " or None", True)
        max_prompt_length = _integer("max_prompt_length", max_prompt_length, 1, " or None", True)
        max_completion_length = _integer("max_completion_length", max_completion_length, 1, " or None", True)
        streaming_buffer_size = _integer("streaming_buffer_size", streaming_buffer_size, 1)
        streaming_validation_documents = _integer("streaming_validation_documents", streaming_validation_documents, 0)
        num_proc = _integer("num_proc", num_proc, 1, " or None (automatic)", True)
        pad_token_id = _integer("pad_token_id", pad_token_id, 0, " or None (from the tokenizer)", True)
        eos_token_id = _integer("eos_token_id", eos_token_id, 0, " or None (from the tokenizer)", True)
        eval_strategy = eval_strategy or strategy
        if on_resume_mismatch not in RESUME_MISMATCH:
            raise ValueError(f"on_resume_mismatch={on_resume_mismatch!r} is not valid; use one of {RESUME_MISMATCH}.")
        for name, value in (("strategy", strategy), ("eval_strategy", eval_strategy)):
            if value not in STRATEGIES:
                raise ValueError(f"Unknown {name} {value!r}; choose one of {list(STRATEGIES)}.")
        if overflow is not None and overflow not in OVERFLOWS:
            raise ValueError(f"overflow={overflow!r} is not valid; use one of {OVERFLOWS} (or None: split text, "
                             "truncate prompt/completion rows).")
        check_packing(packing, overflow or "split")
        check_truncation_side(truncation_side)
        self._limits = PromptCompletionLimits(max_length, max_prompt_length, max_completion_length, truncation_side)
        if max_tokens_per_batch is not None and max_tokens_per_batch < max_length and (
            {strategy, eval_strategy} - {"pad"}
        ):
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
        self.eval_strategy = eval_strategy
        self.pad_to_multiple_of = pad_to_multiple_of
        self.text_column = text_column
        self.num_workers = num_workers
        self.seed = seed
        self.packing = packing
        self.overflow = overflow
        self.allow_split_prompt_completion = allow_split_prompt_completion
        self.group_by_length = group_by_length
        self.pad_to_max_length = pad_to_max_length
        self.max_tokens_per_batch = max_tokens_per_batch
        self.truncation_side = truncation_side
        self.completion_only_loss = completion_only_loss
        self.return_cu_seqlens = return_cu_seqlens
        self.drop_last = drop_last
        self.streaming_buffer_size = streaming_buffer_size
        self.streaming_validation_documents = streaming_validation_documents
        self.num_proc = num_proc
        self.cache_dir = cache_dir
        self.on_resume_mismatch = on_resume_mismatch
        self.streaming = False
        self._tokenizer_arg = tokenizer
        self._tokenizer = None
        self._special_ids = {"pad": pad_token_id, "eos": eos_token_id}
        self._options = BatchingOptions(
            max_length, pad_to_multiple_of, pad_to_max_length, truncation_side, group_by_length,
            max_tokens_per_batch, packing, overflow or "split", return_cu_seqlens,
            plan_cache=str(cache_dir) if cache_dir is not None else str(default_cache_dir()),
        )
        # Chosen once: every question about batches of a split goes to its strategy object.
        self._strategies = {"train": make_strategy(strategy, self._options),
                            "validation": make_strategy(eval_strategy, self._options)}
        self.datasets: dict[str, Any] | None = None
        self._rows: dict[str, Any] = {}
        self._labels: dict[str, Any] = {}  # per split: the token source of labels, where rows carry their own
        self._lengths: dict[str, np.ndarray] = {}  # per row fed to the model, after truncation
        self._stats: dict[str, dict[str, float]] = {}

    # --------------------------------------------------------------------------------------------- resources
    @property
    def tokenizer(self):
        """The tokenizer, loaded on first access (so ``CausalLM`` can read the vocabulary size at setup); ``None``
        for pre-tokenized data given with its ``pad_token_id`` and no tokenizer: the built-in one would not match
        its ids (a model sized from it would index past its embeddings)."""
        if self._tokenizer is None:
            if self._tokenizer_arg is None and self._special_ids["pad"] is not None and self._pretokenized:
                return None
            self._tokenizer = load_tokenizer(self._tokenizer_arg)
        return self._tokenizer

    @property
    def pad_token_id(self) -> int:
        """The pad id: the ``pad_token_id`` argument, else the tokenizer's."""
        if self._special_ids["pad"] is not None:
            return self._special_ids["pad"]
        return int(self.tokenizer.pad_token_id)

    @property
    def eos_token_id(self) -> int | None:
        """The EOS id: the ``eos_token_id`` argument, else the tokenizer's (pre-tokenized rows are used as given,
        so this is for the model's config and generation, not added to rows)."""
        if self._special_ids["eos"] is not None:
            return self._special_ids["eos"]
        return None if self.tokenizer is None else self.tokenizer.eos_token_id

    @override
    def prepare_data(self) -> None:
        """Build what is cached on disk, once per node (Lightning calls this on local rank 0 only): the built-in
        corpus, the default tokenizer and the tokenized dataset; ``setup`` on every rank then only reads them."""
        import datasets

        if isinstance(self.dataset, str) and self.dataset == "builtin":
            from lightning_seqmem.data.corpus import load_builtin_corpus

            load_builtin_corpus()
        if isinstance(self.dataset, (datasets.IterableDataset, datasets.IterableDatasetDict)):
            _ = self.tokenizer
            return
        self.tokenized_documents()
        if "pack" in (self.strategy, self.eval_strategy):
            self.setup("fit")  # plans packing here, once per node: the other ranks' setup maps it (plan_cache)

    def tokenized_documents(self):
        """``(DatasetDict of token columns, kind)``: the documents tokenized through the tokenize-once cache, or
        pre-tokenized data as is; ``kind`` is ``"text"`` or ``"prompt_completion"``. What ``setup`` and
        ``seqmem-plan`` read (the planner only the lengths). Computed once per process: ``prepare_data`` and
        ``setup`` on local rank 0 share it."""
        if self._documents is None:
            self._documents = self._load_documents()
        return self._documents

    def _load_documents(self):
        from lightning_seqmem.data.columns import PRETOKENIZED_KINDS
        from lightning_seqmem.data.token_cache import check_values_once, tokenize_cached

        raw = load_text_dataset(self.dataset)
        kind = check_columns(raw, self.text_column)
        if kind in PRETOKENIZED_KINDS:
            self._pretokenized = True
            explicit = self._tokenizer_arg is not None
            vocab = len(self.tokenizer) if explicit else None
            for split, ds in raw.items():
                check_values_once(ds, kind, split, vocab, cache_dir=self.cache_dir)
            return raw, PRETOKENIZED_KINDS[kind]
        tokenized = tokenize_cached(raw, self.tokenizer, kind, self.text_column, num_proc=self.num_proc,
                                    cache_dir=self.cache_dir, source=self.dataset)
        return tokenized, kind

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.datasets is not None:
            return
        import datasets

        if isinstance(self.dataset, (datasets.IterableDataset, datasets.IterableDatasetDict)):
            return self._setup_streaming()
        # Tokenize (or load the cache prepare_data wrote) before carving out a validation split, so errors name
        # rows of the dataset the user passed.
        tokenized, kind = self.tokenized_documents()
        if kind == "prompt_completion" and self.overflow is None:
            self._options.overflow = "truncate"  # an SFT example is never cut into pieces without its prompt
        if kind == "prompt_completion" and self.overflow == "split" and not self.allow_split_prompt_completion \
                and "pack" in (self.strategy, self.eval_strategy):
            raise ValueError(
                "overflow='split' would cut long prompt/completion rows into pieces, and every piece after the "
                "first would train on completion tokens without their prompt. Leave overflow=None (truncate: keep "
                "the prompt's end and the completion's start), or pass allow_split_prompt_completion=True to "
                "split anyway."
            )
        tokenized = ensure_validation_split(tokenized, seed=self.seed)
        self.datasets = {}
        for split in ("train", "validation"):
            self._setup_split(split, tokenized[split], kind)
        for split in self._stats:
            self._stats[split].update(self._loader_stats(split))

    def _setup_split(self, split: str, ds, kind: str) -> None:
        """Skip empty documents, truncate or pack, and count every token that will not reach the model.

        Works on numpy views of the Arrow columns and on lengths: no token is copied here.
        """
        if kind == "prompt_completion":
            prompt, completion = view_of_dataset(ds, "prompt_ids"), view_of_dataset(ds, "completion_ids")
            lengths = prompt.lengths + completion.lengths
        else:
            source = view_of_dataset(ds, "input_ids")
            labels = view_of_dataset(ds, "labels") if "labels" in ds.column_names else None
            lengths = source.lengths
        keep = np.flatnonzero(lengths > 0)
        empty = len(lengths) - len(keep)
        if empty:
            ds = select_rows(ds, keep, "non-empty")  # an index array: no tokens copied
            lengths = lengths[keep]
            if kind == "prompt_completion":
                prompt, completion = prompt.select(keep), completion.select(keep)
            else:
                source = source.select(keep)
                labels = labels.select(keep) if labels is not None else None
        if split == "train" and len(keep) == 0:
            raise ValueError("Every training document is empty after tokenization: there is nothing to train on.")
        stats = {
            "documents": len(lengths), "empty_documents_skipped": empty, "tokens": int(lengths.sum()),
            "tokens_truncated": 0, "tokens_dropped": 0, "documents_split": 0,
            "documents_over_max_length": int((lengths > self.max_length).sum()),
            "longest_document": int(lengths.max(initial=0)),
        }
        strategy = self._strategies[split]
        if kind == "prompt_completion":
            source, labels = self._prompt_completion_rows(prompt, completion, stats, split)
        self.datasets[split] = ds
        plan = strategy.plan(source, labels)
        for key, value in plan.stats.items():
            stats[key] += value  # adds to any prompt/completion truncation
        self._rows[split], self._lengths[split], self._labels[split] = plan.rows, plan.lengths, labels
        self._stats[split] = stats
        self._report(split, stats)

    def _prompt_completion_rows(self, prompt, completion, stats: dict, split: str):
        """Truncate prompt/completion pairs once, at dataset level and on lengths, so every cut token is counted
        exactly; rows are views (the kept part of the prompt, then of the completion), gathered when served."""
        limits = self._strategies[split].prompt_completion_limits(self._limits)
        p_off, p_keep, c_keep = prompt_completion_spans(prompt.lengths, completion.lengths, limits)
        truncated = int((prompt.lengths + completion.lengths - p_keep - c_keep).sum())
        kept = np.flatnonzero(c_keep > 0)
        emptied = len(c_keep) - len(kept)  # nothing to learn from: reported below, never trained on silently
        truncated += int((p_keep[c_keep == 0]).sum())
        prompt = prompt.trim(p_off, p_keep).select(kept)
        completion = completion.trim(np.zeros_like(c_keep), c_keep).select(kept)
        source = ConcatView(prompt, completion)
        labels = ConcatView(ConstantView(IGNORE_INDEX, prompt.lengths) if self.completion_only_loss else prompt, completion)
        stats.update(tokens_truncated=truncated, rows_without_completion=emptied)
        if emptied:
            rank_zero_warn(
                f"{split}: {emptied} prompt/completion rows have no completion left after truncation and are "
                "skipped. Lower max_prompt_length or raise max_length to keep them."
            )
        return source, labels

    def _setup_streaming(self) -> None:
        if self.strategy != "pack" or self.eval_strategy != "pack":
            raise ValueError(
                f"A streaming dataset is packed on the fly: use strategy='pack' (strategy={self.strategy!r}, "
                f"eval_strategy={self.eval_strategy!r}; the others need the whole dataset), or load it without "
                "streaming=True."
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
        """One streamed document to ``[bos] + tokens + [eos]``, as ``data.encode`` does for map-style data."""
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
        packer = StreamingPacker(self.max_length, self.streaming_buffer_size, self._options.overflow)
        cycle = world > 1 and split == "train"
        rows = _StreamingRows(self.datasets[split], self._encode, packer, rank, world, cycle=cycle)
        return DataLoader(rows, batch_size=self._rows_per_batch(split), collate_fn=self._collator(split),
                          num_workers=self.num_workers)

    def _report(self, split: str, stats: dict) -> None:
        truncated, dropped = stats["tokens_truncated"], stats["tokens_dropped"]
        strategy = self._strategies[split].name
        if truncated + dropped:
            if strategy != "pack":
                fix = "Raise max_length, or use strategy='pack' (overflow='split') to keep them."
            elif "rows_without_completion" in stats:
                fix = "Raise max_length, or max_prompt_length / max_completion_length, to keep them."
            elif self._options.overflow != "split":
                fix = "Use overflow='split' to keep them (a long document becomes max_length pieces)."
            else:
                fix = "Raise max_prompt_length / max_completion_length to keep them."
            rank_zero_warn(
                f"{split}: {stats['documents_over_max_length']} documents are longer than max_length={self.max_length}; "
                f"with strategy={strategy!r}, {truncated + dropped:,} of {stats['tokens']:,} tokens "
                f"({100 * (truncated + dropped) / max(stats['tokens'], 1):.2f}%) never reach the model "
                f"({truncated:,} truncated, {dropped:,} dropped). {fix}"
            )
        if stats["empty_documents_skipped"]:
            rank_zero_info(f"[lightning_seqmem] {split}: skipped {stats['empty_documents_skipped']} empty documents.")

    # ------------------------------------------------------------------------------------------------ loaders
    def _collator(self, split: str = "train"):
        return self._strategies[split].collator(self.pad_token_id)

    def _rows_per_batch(self, split: str) -> int:
        batch_size = self.micro_batch_size if split == "train" else self.eval_batch_size
        return self._strategies[split].rows_per_batch(batch_size)

    def _sampler(self, split: str, num_replicas: int | None = None, rank: int | None = None):
        """This rank's batch sampler for ``split`` (train shuffles with ``seed + epoch``)."""
        batch_size = self.micro_batch_size if split == "train" else self.eval_batch_size
        return self._strategies[split].split_sampler(self._lengths[split], batch_size, split == "train", self.seed,
                                                     self.drop_last, num_replicas, rank)

    def _loader(self, split: str) -> DataLoader:
        if self.datasets is None:
            self.setup("fit")
        if self.streaming:
            return self._streaming_loader(split)
        loader = _ResumableLoader(
            BatchFetcher(self._rows[split]), sampler=self._sampler(split), batch_size=None,
            collate_fn=self._collator(split), num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
        )
        loader.skip_resume_state = self._skip_resume_state
        return loader

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader("validation")

    # ---------------------------------------------------------------------------------------------- reporting
    def batch_keys(self) -> tuple[str, ...]:
        """The keys of the batches the train loader yields (``eval_strategy`` may differ: see its loader)."""
        return tuple(self._strategies["train"].keys)

    def worst_batch_layout(self, rows: int, length: int) -> tuple[tuple[int, ...], ...]:
        """Document lengths per row of the costliest ``[rows, length]`` training batch
        (``protocols.GivesWorstBatchLayout``, asked by ``CachePreallocator``): the train strategy's answer."""
        if self.datasets is None:
            self.setup("fit")
        return self._strategies["train"].worst_layout(rows, length, self._lengths.get("train"))

    def _epoch_stats(self, split: str):
        """Epoch 0 of ``split`` on one process (``strategies.EpochStats``)."""
        return self._strategies[split].epoch_stats(self._lengths[split], self._sampler(split, num_replicas=1, rank=0))

    def max_batch_shape(self) -> tuple[int, int]:
        """The largest ``(rows, length)`` any loader (train or validation, whatever its strategy) yields, for
        pre-allocation. With a token budget, rows and length vary together: the shape with the most slots."""
        if self.datasets is None:
            self.setup("fit")
        if self.streaming:
            return max(self._rows_per_batch("train"), self._rows_per_batch("validation")), self.max_length
        largest = [self._epoch_stats(split).largest for split in self._rows if len(self._rows[split])]
        return largest_shape(list(self._strategies.values()), [s for s in largest if s is not None])

    def _loader_stats(self, split: str) -> dict[str, float]:
        """One epoch on one process: rows, batches, rows ``drop_last`` leaves out, real tokens / slots."""
        return self._epoch_stats(split).counts()

    def stats(self) -> dict[str, Any]:
        """Per split: documents, tokens, tokens truncated/dropped, documents split, empty documents skipped,
        rows, batches, rows ``drop_last`` leaves out, and token efficiency (real tokens / slots in one epoch);
        for prompt/completion data also the rows skipped because no completion was left."""
        if self.datasets is None:
            self.setup("fit")
        return {split: dict(values) for split, values in self._stats.items()}

    # ------------------------------------------------------------------------------------------------ resume
    def data_signature(self) -> dict[str, Any]:
        """What a saved loader position refers to: the settings that decide the train rows and their batches, and a
        checksum of the train row lengths (so another dataset or tokenizer shows too)."""
        import zlib

        if self.datasets is None:
            self.setup("fit")
        lengths = np.ascontiguousarray(self._lengths.get("train", np.zeros(0)), dtype=np.int64)
        return {
            "strategy": self.strategy, "max_length": self.max_length, "micro_batch_size": self.micro_batch_size,
            "seed": self.seed, "packing": self.packing, "overflow": self._options.overflow,
            "group_by_length": self.group_by_length, "max_tokens_per_batch": self.max_tokens_per_batch,
            "drop_last": self.drop_last, "train_rows": int(lengths.size), "train_lengths_crc32": zlib.crc32(lengths),
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        """Saved in Lightning checkpoints: the data signature, checked when a run resumes from it."""
        if self.streaming or self.datasets is None:
            return {}
        return {"data_signature": self.data_signature()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Compare the checkpoint's data signature with this run's before the loader position is restored
        (Lightning restores the DataModule first): a changed dataset or batching makes that position meaningless."""
        saved = state_dict.get("data_signature")
        if not saved or self.streaming:
            return
        now = self.data_signature()
        changed = {k: (saved.get(k), now.get(k)) for k in now if saved.get(k) != now.get(k)}
        self._skip_resume_state = False
        if not changed:
            return
        if "train_lengths_crc32" in changed and "train_rows" not in changed and len(changed) == 1:
            what = "the train rows have other lengths (another dataset, tokenizer or packing)"
        else:
            what = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items()
                             if k != "train_lengths_crc32")
        if self.on_resume_mismatch == "error":
            raise ValueError(
                f"Cannot resume the data position of this checkpoint: it was saved with other data ({what}), so the "
                "batches it had already yielded are not this run's. Resume with the same data settings, or pass "
                "on_resume_mismatch='restart_epoch' to keep the checkpoint's model and optimizer and start the "
                "current epoch from its first batch (or start a new run without ckpt_path)."
            )
        rank_zero_warn(f"The checkpoint's data differ from this run's ({what}): the current epoch restarts from its "
                       "first batch (on_resume_mismatch='restart_epoch'); model and optimizer state are resumed.")
        self._skip_resume_state = True
