"""``SeqMemDataModule``: text in, padded / truncated / packed batches out, with every lost token counted.

The work happens elsewhere: the arguments become one frozen ``SeqMemSettings`` (``settings.py``), the data are read
by the read mode of their place in the 2 x 2 (``read_paths.py``: one source or a ``Mix``, map-style through the
pure split pipeline, ``pipeline.py``, or streamed by the stream engine, ``streams/``), what differs between kinds of
data is asked of the kind (``lightning_seqmem.kinds``), and every question about batches goes to the split's
strategy object (``batching/strategies.py``).
This class only wires them to Lightning's ``prepare_data``/``setup``/``*_dataloader`` hooks.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_seqmem._hparams import save_hyperparameters
from lightning_seqmem.batching.options import Batching
from lightning_seqmem.data.columns import LargestTokenId
from lightning_seqmem.data.node_agreement import agree_once_per_group
from lightning_seqmem.data.sources import BUILTIN_CHAT, open_stream
from lightning_seqmem.datamodule.batch_answers import BatchAnswers
from lightning_seqmem.datamodule.pipeline import load_documents
from lightning_seqmem.datamodule.read_mode import ReadMode
from lightning_seqmem.datamodule.read_paths import read_mode_for
from lightning_seqmem.datamodule.settings import SeqMemSettings
from lightning_seqmem.datamodule.tokenizer_ids import LazyTokenizer, TokenizerIds
from lightning_seqmem.kinds.detect import detect_stream
from lightning_seqmem.mixing.spec import Mix
from lightning_seqmem.streams.reading import is_stream

_NOT_SETTINGS = ("self", "dataset", "tokenizer", "__class__", "prepare_data_per_node")


class SeqMemDataModule(TokenizerIds, BatchAnswers, LightningDataModule):
    """Variable-length text for causal-LM training.

    Map-style data lives in the Arrow tables ``datasets`` keeps memory-mapped: tokens are read as numpy views,
    rows are planned from lengths and gathered when served, so memory grows with documents, not tokens.
    Tokenization runs once per node (``prepare_data``) and is cached under ``cache_dir``.

    Args:
        dataset: ``"builtin"`` (the standard-library corpus), ``"builtin_chat"`` (it as conversations),
            ``"builtin_preference"`` (it as preference pairs), a ``datasets.Dataset``/``DatasetDict``, a
            ``pandas.DataFrame``, local
            json/jsonl/parquet/txt/csv files (path, glob or list), a ``save_to_disk`` directory, a hub name, or a
            Python list of documents, rows or conversations; or a ``Mix`` of several of these by weight
            (docs/mixing.md). A ``text`` column, ``prompt`` and ``completion`` columns, a ``messages`` column of
            conversations, or preference pairs (``prompt``, ``chosen``, ``rejected``); or pre-tokenized:
            ``input_ids`` (optionally ``labels``), ``prompt_ids`` and ``completion_ids``, or ``prompt_ids``,
            ``chosen_ids`` and ``rejected_ids``, used as they are.
            Pairs are batched in TRL's padded layout (``pad``/``truncate``: ``[2B, L]``, chosen rows then rejected
            rows, with ``completion_mask``) or packed whole (``pack``: ``B`` rows of ``2 * max_length``, with
            ``sequence_index``); optional ``ref_chosen_logps``/``ref_rejected_logps`` columns come along as
            ``[pairs]`` tensors. A ``test`` split is served to ``trainer.test`` and ``trainer.predict``.
        tokenizer: ``None`` for the built-in BPE tokenizer, a name or local path for ``AutoTokenizer``, or a
            tokenizer object.
        max_length: longest row fed to the model, in tokens.
        micro_batch_size: rows per training batch on each device (before gradient accumulation).
        eval_batch_size: rows per validation batch; defaults to ``micro_batch_size`` (same memory profile).
        batching: how the training loader batches, with the strategy's own options
            (``lightning_seqmem.batching.options``): ``Pad(to_multiple_of=8, to_max_length=False,
            group_by_length=False)`` pads each batch to its longest row; ``Truncate()`` cuts and pads every row to
            ``max_length``; ``Pack(method="bfd" | "wrapped", overflow=None | "split" | "truncate" | "drop" |
            "error", allow_split_prompt_completion=False, cu_seqlens=False)`` packs documents into ``max_length``
            rows, no padding between them (``overflow=None``: ``"split"`` for text, ``"truncate"`` for
            prompt/completion rows and conversations). ``None`` (default): ``strategy``, else ``Pack()``, as the
            main job (``seqmem-train``'s ``batching=pack_bfd``): no token lost, long text documents split.
        eval_batching: the validation loader's; ``None`` (default): the training loader's. E.g.
            ``batching=Pack(), eval_batching=Pad()`` trains packed and validates one document per row.
        strategy: ``batching`` by name, the names of ``batching=`` in ``seqmem-train``: ``"pad"``, ``"truncate"``,
            ``"pack_bfd"`` (or ``"pack"``: ``batching=Pack()``), ``"pack_wrapped"``, options in brackets
            (``"pad(to_max_length=True)"``); give one of the two.
        eval_strategy: shorthand for ``eval_batching`` with its defaults.
        text_column: the column holding the text.
        num_workers: DataLoader worker processes.
        seed: seeds shuffling and the validation split; epoch ``e`` uses ``seed + e`` on every rank.
        max_tokens_per_batch: token budget (rows x padded length) per batch; ``pad`` gets a variable number of
            rows, ``truncate``/``pack`` get ``max_tokens_per_batch // max_length`` rows.
        truncation_side: ``"right"`` keeps the start of a long document, ``"left"`` its end. Prompt/completion
            rows over ``max_length``: ``"right"`` cuts the completion's end first, ``"left"`` the prompt's start.
        max_prompt_length: prompt/completion and preference data: keep the last ``max_prompt_length`` prompt tokens.
        max_completion_length: prompt/completion and preference data: keep the first ``max_completion_length``
            completion tokens (each of a pair's two).
        truncation_mode: preference data: how ``max_length`` then cuts each prompt + completion, TRL's
            ``"keep_start"`` or ``"keep_end"``; ``None``: ``"keep_start"`` for ``truncation_side="right"``,
            ``"keep_end"`` for ``"left"``.
        completion_only_loss: prompt/completion data: labels -100 on the prompt.
        drop_last: drop the incomplete tail of an epoch (counted in ``stats()``) instead of smaller last batches.
        streaming: serve ``dataset`` as a stream (packed: ``batching=Pack()``), files and hub names read as trained on.
        streaming_buffer_size: streams (``datasets.IterableDataset``): documents held in the best-fit window.
        streaming_validation_documents: a stream without a ``validation`` split gives its first this many
            documents to validation (held in memory; training leaves them out).
        streaming_shuffle_buffer: streams: each reader draws its next document at random from this many (seeded by
            ``seed``, the epoch, the rank and the worker) before packing; ``0`` (default) reads in order. Unlike
            ``datasets``' own ``shuffle(buffer_size=...)``, whose buffer a checkpoint loses, it resumes exactly.
        num_proc: processes for tokenization; ``None``: 1 for small datasets, else ``min(8, cpus // 2)``.
        cache_dir: where tokenized datasets are cached (keyed by the data, the tokenizer's content and the
            framing); ``None``: ``$XDG_CACHE_HOME/lightning_seqmem`` (or ``~/.cache/lightning_seqmem``).
        pad_token_id, eos_token_id: pre-tokenized data: the special ids, when no tokenizer gives them (with
            ``pad_token_id`` given, the data path never loads a tokenizer); ``dm.pad_token_id``/``dm.eos_token_id``.
        on_resume_mismatch: a checkpoint whose data position was saved with other rows (another ``max_length``,
            strategy, dataset, batch size or seed): ``"error"`` (default) refuses to resume and names what
            changed; ``"restart_epoch"`` keeps the checkpoint's model and optimizer but starts the current epoch
            from its first batch.
        train_on: conversations (a ``messages`` column of ``{"role", "content"}`` turns, rendered with the
            tokenizer's chat template): which tokens carry loss. ``"assistant"`` (every assistant turn, its content
            and the tokens that close it), ``"last_assistant"`` or ``"all"``. A conversation over ``max_length``
            loses whole oldest turns first (the system message stays); conversations are never split by ``pack``.
        train_field: conversations: a per-message boolean that overrides ``train_on`` for that turn (``None``: none).
        on_empty_labels: conversations with no trained token (no assistant turn, or none left after truncation):
            ``"drop"`` (counted in ``stats()``), ``"keep"`` (they add no loss) or ``"error"``.
        prepare_data_per_node: Lightning's: ``True`` tokenizes on every node's first process (node-local caches);
            ``False`` on the job's first process only, the others reading its cache (docs/many_machines.md).

    Example::

        dm = SeqMemDataModule(max_length=512, micro_batch_size=8, batching=Pack(method="bfd"))
        trainer.fit(CausalLM(), datamodule=dm)
        print(dm.stats())
    """

    _documents = None  # (tokenized DatasetDict, kind), once per process
    _largest_token_id = None  # pre-tokenized data: their largest id, found with _documents
    _detected = None  # a stream's data kind, once detected
    _agreed_group = None  # the process group whose ranks compared their data (``setup``)

    def __init__(
        self,
        dataset: Mix | Any = "builtin",
        tokenizer: Any = None,
        max_length: int = 512,
        micro_batch_size: int = 8,
        eval_batch_size: int | None = None,
        batching: Batching | None = None,
        eval_batching: Batching | None = None,
        strategy: str | None = None,
        eval_strategy: str | None = None,
        text_column: str = "text",
        num_workers: int = 0,
        seed: int = 42,
        max_tokens_per_batch: int | None = None,
        truncation_side: str = "right",
        max_prompt_length: int | None = None,
        max_completion_length: int | None = None,
        truncation_mode: str | None = None,
        completion_only_loss: bool = True,
        drop_last: bool = False,
        streaming: bool = False,
        streaming_buffer_size: int = 1000,
        streaming_validation_documents: int = 100,
        streaming_shuffle_buffer: int = 0,
        num_proc: int | None = None,
        cache_dir: str | os.PathLike | None = None,
        pad_token_id: int | None = None,
        eos_token_id: int | None = None,
        on_resume_mismatch: str = "error",
        train_on: str = "assistant",
        train_field: str | None = "train",
        on_empty_labels: str = "drop",
        prepare_data_per_node: bool = True,
    ) -> None:
        super().__init__()
        self.prepare_data_per_node = prepare_data_per_node  # Lightning's own attribute (LightningCLI sets it here)
        arguments = {k: v for k, v in locals().items() if k not in _NOT_SETTINGS}  # before any other local
        self.settings = SeqMemSettings.from_arguments(**arguments)  # every argument checked here, once
        save_hyperparameters(
            self,
            self.settings.hyperparameters(),
            # Lightning compares the saved dict with every __init__ argument (``==``) to name it; a DataFrame's
            # ``==`` is elementwise and raises. The data and the tokenizer are never hyperparameters.
            ignore=["dataset", "tokenizer"],
        )
        self.dataset = dataset
        self._lazy_tokenizer = LazyTokenizer(tokenizer, self.settings.data.pad_token_id)
        # Set up once (``setup``), then never changed: every question about the data goes to the read mode, and
        # every question about a split's batches to its strategy object (``read_mode.strategies``).
        self.read_mode: ReadMode | None = None
        self.datasets: dict[str, Any] | None = None
        self._superseded: list[dict[str, Any]] = []  # data signatures before micro_batch_size was set (the finder)

    # ----------------------------------------------------------------------------------------- read by others
    @property
    def micro_batch_size(self) -> int:
        """Rows per training batch (``settings.batching.micro_batch_size``). Settable, for Lightning's batch-size
        finder: ``Tuner(trainer).scale_batch_size(model, datamodule=dm, batch_arg_name="micro_batch_size")``."""
        return self.settings.batching.micro_batch_size

    @micro_batch_size.setter
    def micro_batch_size(self, value: int) -> None:
        """The settings rebuilt with ``value`` (checked as in ``__init__``) and the read mode set up again from the
        tokenized data, so the next loader, ``stats()`` and the batch shapes use it (an unset ``eval_batch_size``
        follows it)."""
        batching = dataclasses.replace(self.settings.batching, micro_batch_size=value)
        if self.read_mode is not None:
            self._superseded.append(self.read_mode.data_signature())
        self.settings = dataclasses.replace(self.settings, batching=batching)
        self.hparams["micro_batch_size"] = batching.micro_batch_size
        self.read_mode, self.datasets = None, None

    @property
    def batch_size(self) -> int:
        """``micro_batch_size`` under the name Lightning's batch-size finder looks for by default
        (``Tuner(trainer).scale_batch_size(model, datamodule=dm)``); setting it sets ``micro_batch_size``."""
        return self.micro_batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self.micro_batch_size = value

    @override
    def prepare_data(self) -> None:
        """Build what is cached on disk, once per node (Lightning calls this on local rank 0 only): the built-in
        corpus, the default tokenizer and the tokenized dataset; ``setup`` on every rank then only reads them."""
        if isinstance(self.dataset, Mix):  # each source tokenized and planned (mix_mode.py)
            return self._read()
        if self._open_stream():
            # token ids need no tokenizer: know the kind before asking for one (a hub tokenizer is downloaded once
            # per node); a stream itself is read as trained on
            self._pretokenized = self._stream_kind().pretokenized
            _ = self.tokenizer
            return
        if isinstance(self.dataset, str) and self.dataset in ("builtin", BUILTIN_CHAT):
            from lightning_seqmem.data.corpus import load_builtin_corpus

            load_builtin_corpus()
        self.tokenized_documents()
        if self.settings.batching.packs_any():
            self._read()  # plans packing here, once per node: the other ranks' setup maps it (plan_cache)

    def _stream_kind(self):
        """The stream's data kind, detected once (a stream without features reads its first row to tell)."""
        if self._detected is None:
            self._detected = detect_stream(self.dataset, self.settings.data.text_column)
        return self._detected

    def _open_stream(self) -> bool:
        """Whether the dataset is a stream, made one first when ``streaming=True``."""
        if self.settings.data.streaming and not is_stream(self.dataset):
            self.dataset = open_stream(self.dataset)
        return is_stream(self.dataset)

    def tokenized_documents(self):
        """``(DatasetDict of token columns, kind)``: the documents tokenized through the tokenize-once cache, or
        pre-tokenized data as is; ``kind`` the data kind (``lightning_seqmem.kinds``: ``kind.name`` is ``"text"``,
        ``"prompt_completion"``, ``"conversations"`` or ``"preference"``). What ``setup`` and ``seqmem-plan`` read
        (the planner only the lengths). Computed once per process: ``prepare_data`` and ``setup`` on local rank 0
        share it."""
        if self._documents is None:
            tokenized, kind, self._largest_token_id = load_documents(
                self.dataset,
                self.settings.data,
                self._lazy_tokenizer,
                self._tokenizer_arg is not None,
                self.settings.conversation,
            )
            self._documents, self._pretokenized = (tokenized, kind), kind.pretokenized
        return self._documents

    def largest_token_id(self) -> LargestTokenId | None:
        """Pre-tokenized map-style data: their largest token id, with the split and column holding it
        (``protocols.GivesLargestTokenId``; ``CausalLM`` refuses a model with no embedding row for it). Found by
        the value check the data get once per dataset version, and remembered with it: later runs read no token.
        ``None`` for text (the tokenizer's size bounds its ids: ``CausalLM`` checks that) and for streams, whose
        ids are checked only against a given tokenizer, as they are read."""
        if isinstance(self.dataset, Mix):
            return self._ready().largest_token_id()
        if self._open_stream():
            return None
        self.tokenized_documents()
        return self._largest_token_id

    @override
    def setup(self, stage: str | None = None) -> None:
        """Read the data once, by the read mode of their place in the 2 x 2 (``read_paths.read_mode_for``: one
        source or a ``Mix``, map-style or streamed); then, each time a process group of several ranks is up, compare
        every rank's tokenized data (nodes holding other copies stop, named). The comparison is a collective every
        rank meets here in ``fit``, even one that read its data before the group existed (an app's early checks)."""
        self._read()
        self._agreed_group = agree_once_per_group(self.read_mode.tokenized, self._agreed_group)

    def _read(self) -> None:
        """The read mode, once per process (``prepare_data`` reads through it too: no collective here)."""
        if self.read_mode is not None:
            return
        stream = not isinstance(self.dataset, Mix) and self._open_stream()
        documents = self._stream_kind if stream else self.tokenized_documents
        args = (self.settings, self._lazy_tokenizer, self._tokenizer_arg is not None, rank_zero_warn, rank_zero_info)
        self.read_mode = read_mode_for(self.dataset, stream, documents, *args)
        self._pretokenized = self.read_mode.pretokenized
        self.datasets = self.read_mode.datasets

    @property
    def streaming(self) -> bool:
        """Whether the data are served as streams, one source or a ``Mix`` (``ConfigChecks`` asks)."""
        if self.read_mode is not None:
            return self.read_mode.streaming
        return self.settings.data.streaming or (not isinstance(self.dataset, Mix) and is_stream(self.dataset))

    # ---------------------------------------------------------------------------------------------- checkpoints
    def data_signature(self) -> dict[str, Any]:
        """What a saved loader position refers to (``signature.read_signature``, the same for every read path)."""
        return self._ready().data_signature()

    @override
    def state_dict(self) -> dict[str, Any]:
        """Saved in Lightning checkpoints: the data signature, checked when a run resumes from it."""
        return {} if self.read_mode is None else self.read_mode.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check the checkpoint's data signature before the train loader is built (Lightning restores the DataModule
        first): other data are refused by name, or the loader is built to start the epoch afresh. A checkpoint saved
        before ``micro_batch_size`` was set (the batch-size finder restores its model) restarts without a word."""
        if state_dict.get("data_signature") in self._superseded:
            self._ready().restart = True
            return
        self._ready().load_state_dict(state_dict, rank_zero_warn)

    def _batches_fetched_ahead(self) -> int:
        """Train batches Lightning has fetched but not yet trained on (its fetcher keeps one ahead of a stream)."""
        fetcher = getattr(getattr(self.trainer, "fit_loop", None), "_data_fetcher", None)
        return len(getattr(fetcher, "batches", None) or ())

    # ------------------------------------------------------------------------------------------------ loaders
    def _ready(self) -> ReadMode:
        """The read mode, read first if needed (on this rank alone: the ranks compare their data in ``setup``)."""
        self._read()
        return self.read_mode

    @override
    def train_dataloader(self) -> DataLoader:
        return self._ready().loader("train", self.tokenizer, self.pad_token_id, self._batches_fetched_ahead)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._ready().loader("validation", self.tokenizer, self.pad_token_id)

    @override
    def test_dataloader(self) -> DataLoader:
        """The ``test`` split (of a ``DatasetDict`` or a stream), batched as validation (``eval_batching``,
        ``eval_batch_size``, in order) and counted in ``stats()["test"]``; data without one: a ``ValueError``."""
        read_mode = self._ready()
        if "test" not in read_mode.datasets:
            raise ValueError(
                f"trainer.test needs a 'test' split; the data have {sorted(read_mode.datasets)}. Pass a DatasetDict "
                "that has one (DatasetDict(train=..., validation=..., test=...)), or a saved dataset or hub name "
                "with a 'test' split; trainer.predict serves the validation split without one."
            )
        return read_mode.loader("test", self.tokenizer, self.pad_token_id)

    @override
    def predict_dataloader(self) -> DataLoader:
        """The ``test`` split when the data have one, else the validation split (batched as validation)."""
        split = "test" if "test" in self._ready().datasets else "validation"
        return self.read_mode.loader(split, self.tokenizer, self.pad_token_id)
