"""Sequence Length Warmup
======================

``SeqLengthWarmup`` cuts every training batch to a sequence length that grows over the first part of training
(Li et al., 2021; MosaicML Composer's ``SeqLengthWarmup``). The work is done by two pure functions,
:func:`~lightning_seqmem.warmup.schedule.seq_length_at` and
:func:`~lightning_seqmem.warmup.transform.set_batch_sequence_length`; this callback only decides when to call them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_seqmem.batch import count_real_tokens
from lightning_seqmem.protocols import GivesMaxBatchShape, find_pad_token_id
from lightning_seqmem.warmup.schedule import check_schedule_args, seq_length_at, warmup_lengths
from lightning_seqmem.warmup.transform import reshaped_batch_shape, set_batch_sequence_length

__all__ = ["SeqLengthWarmup"]

_PREFIX = "seq_length_warmup"


class SeqLengthWarmup(Callback):
    """Grow the training sequence length from ``min_seq_length`` to ``max_seq_length`` over the first ``duration``
    of training, then train at ``max_seq_length``.

    Progress is counted in optimizer steps (``trainer.global_step`` out of ``trainer.estimated_stepping_batches``),
    or in real tokens trained on when ``total_tokens`` is given, so every micro-batch of one gradient-accumulation
    window and every DDP rank uses the same length. Validation and test batches are never cut. In reshape mode
    (``truncate=False``) the tokens cut off become new rows instead of being thrown away.

    Logs ``seq_length_warmup/seq_len``, ``seq_length_warmup/rows`` (rows per batch after the cut) and
    ``seq_length_warmup/tokens_seen`` (real tokens trained on after the cut, summed over ranks, cumulative).

    Args:
        duration: fraction of training spent warming up, in ``[0, 1]``; ``0`` switches warmup off.
        min_seq_length: sequence length at the first step, ``>= 1``.
        max_seq_length: sequence length from the end of warmup on; set it to the DataModule's ``max_length``.
        step_size: lengths inside warmup are multiples of it; keep it a multiple of 8.
        truncate: ``True`` drops the tokens past the current length; ``False`` reshapes them into new rows.
        preserve_end_of_sequence: with ``truncate=True``, keep each row's last real token (EOS) as its last token.
        curve: ``"linear"`` (Composer) or ``"fixed_root"`` (DeepSpeed's curriculum learning).
        root_degree: root of the ``fixed_root`` curve.
        total_tokens: a token budget: progress is real tokens trained on (over all ranks) out of ``total_tokens``
            instead of optimizer steps. Required for an unsized train loader without ``Trainer(max_steps=...)``.
        pad_token_id: recognises padding in packed batches; defaults to ``trainer.datamodule.pad_token_id`` or the
            LightningModule's ``pad_token_id`` (attribute or hyper-parameter).

    Raises:
        ValueError: ``duration`` outside ``[0, 1]``, ``min_seq_length < 1``, ``min_seq_length > max_seq_length``,
            ``step_size < 1``, an unknown ``curve``, ``total_tokens < 1``, or ``preserve_end_of_sequence`` with
            ``truncate=False``.
        MisconfigurationException: at ``fit``, when the number of optimizer steps is unknown and there is no
            ``total_tokens``.

    Example::

        from lightning.pytorch import Trainer
        from lightning_seqmem import SeqLengthWarmup

        warmup = SeqLengthWarmup(duration=0.3, min_seq_length=8, max_seq_length=512)
        Trainer(max_steps=10_000, callbacks=[warmup]).fit(model, datamodule=dm)
    """

    def __init__(
        self,
        duration: float = 0.3,
        min_seq_length: int = 8,
        max_seq_length: int = 1024,
        step_size: int = 8,
        truncate: bool = True,
        preserve_end_of_sequence: bool = False,
        curve: str = "linear",
        root_degree: int = 2,
        total_tokens: int | None = None,
        pad_token_id: int | None = None,
    ) -> None:
        super().__init__()
        check_schedule_args(duration, min_seq_length, max_seq_length, step_size, curve, root_degree)
        if preserve_end_of_sequence and not truncate:
            raise ValueError(
                "preserve_end_of_sequence=True only applies to truncate=True (reshape keeps every token); "
                "set truncate=True or preserve_end_of_sequence=False."
            )
        if total_tokens is not None and (
            isinstance(total_tokens, bool) or not isinstance(total_tokens, int) or total_tokens < 1
        ):
            raise ValueError(f"total_tokens must be a positive int (a token budget) or None, got {total_tokens!r}.")
        if step_size % 8:
            rank_zero_warn(
                f"SeqLengthWarmup(step_size={step_size}): lengths that are not multiples of 8 run slower on tensor "
                "cores. Use step_size=8 (or 64) unless you mean it."
            )
        self.duration = float(duration)
        self.min_seq_length = min_seq_length
        self.max_seq_length = max_seq_length
        self.step_size = step_size
        self.truncate = truncate
        self.preserve_end_of_sequence = preserve_end_of_sequence
        self.curve = curve
        self.root_degree = root_degree
        self.total_tokens = total_tokens
        self.pad_token_id = pad_token_id

        self._total_steps: int | None = None
        self._tokens_seen = 0  # over all ranks, as of the last optimizer step: the same number on every rank
        self._pending: torch.Tensor | None = None  # this rank's tokens since the last optimizer step
        self._last_step = 0
        self._rows = 0
        self._pad_token_id: int | None = pad_token_id
        self._warned_long_batch = False
        self._longest_seen = 0  # the longest training batch so far, before the cut (when no DataModule tells)
        self._checked_cut = False  # whether warmup was found to cut nothing (told once)

    # ------------------------------------------------------------------------------------------ public API

    def seq_length(self, progress: int, total: int) -> int:
        """The schedule of this callback: sequence length after ``progress`` of ``total`` steps (or tokens)."""
        return seq_length_at(
            progress,
            total,
            self.duration,
            self.min_seq_length,
            self.max_seq_length,
            self.step_size,
            self.curve,
            self.root_degree,
        )

    def batch_shapes(self, rows: int, length: int) -> list[tuple[int, int]]:
        """Every ``(rows, seq)`` shape a ``[rows, length]`` training batch can take under this warmup, shortest first.

        Example::

            SeqLengthWarmup(min_seq_length=8, max_seq_length=32, truncate=False).batch_shapes(4, 32)
            # [(16, 8), (8, 16), (5, 24), (4, 32)]
        """
        lengths = (
            [self.max_seq_length]
            if self.duration == 0
            else warmup_lengths(self.min_seq_length, self.max_seq_length, self.step_size)
        )
        shapes = [reshaped_batch_shape(rows, length, curr, self.truncate) for curr in lengths]
        return list(dict.fromkeys(shapes))

    def max_warmup_shape(self, rows: int, length: int) -> tuple[int, int]:
        """Largest batch shape this warmup makes of ``[rows, length]`` batches: the most tokens, then the longest rows.

        Truncation gives ``(rows, min(length, max_seq_length))``. Reshape gives more rows of fewer tokens, never more
        than ``rows * length`` tokens in all; for memory planning the longest of those layouts is the worst case.
        This answers :class:`~lightning_seqmem.protocols.GivesWarmupShape` (``CachePreallocator`` asks it).

        Example::

            SeqLengthWarmup(max_seq_length=64, truncate=False).max_warmup_shape(8, 128)  # (16, 64)
        """
        return max(self.batch_shapes(rows, length), key=lambda shape: (shape[0] * shape[1], shape[1]))

    @property
    def tokens_seen(self) -> int:
        """Real tokens trained on (after the cut) over all ranks, as of the last optimizer step."""
        return self._tokens_seen

    # ------------------------------------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._check_against_datamodule(trainer)
        if self.duration == 0 or self.min_seq_length == self.max_seq_length:
            self._total_steps = 1  # warmup is off: always max_seq_length, whatever the run length
        elif self.total_tokens is None:
            total = trainer.estimated_stepping_batches
            if total == 0:
                rank_zero_warn(
                    f"SeqLengthWarmup: this run takes no optimizer step (Trainer(max_steps={trainer.max_steps}, "
                    f"max_epochs={trainer.max_epochs}): {total} steps), so warmup never cuts a batch; fit trains "
                    "nothing (validation may still run). Give max_steps > 0 (or max_epochs > 0) to train."
                )
                self._total_steps = 1
            elif not math.isfinite(total) or total < 1:  # -1: an unsized loader and no max_steps
                raise MisconfigurationException(
                    "SeqLengthWarmup follows the optimizer step out of `trainer.estimated_stepping_batches`, which is "
                    f"unknown here ({total}: an unsized train loader, e.g. an IterableDataset, and no max_steps). Set "
                    "Trainer(max_steps=...) or give the callback a token budget: SeqLengthWarmup(total_tokens=...)."
                )
            else:
                self._total_steps = int(total)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._pad_token_id is None:
            self._pad_token_id = find_pad_token_id(trainer.datamodule, pl_module, pl_module.hparams)
        self._last_step = trainer.global_step
        self._pending = None

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.total_tokens is not None:
            seq_len = self.seq_length(self._tokens_seen, self.total_tokens)
        else:
            seq_len = self.seq_length(trainer.global_step, self._total_steps or trainer.estimated_stepping_batches)
        self._warn_long_batch(batch)
        self._warn_nothing_cut(batch, seq_len)
        # The same dict object goes on to training_step, so the in-place change is what the model sees.
        set_batch_sequence_length(batch, seq_len, self.truncate, self.preserve_end_of_sequence, self._pad_token_id)
        first = (
            batch["input_ids"]
            if "input_ids" in batch
            else next(v for v in batch.values() if isinstance(v, torch.Tensor) and v.ndim == 2)
        )
        self._rows = first.shape[0]
        tokens = count_real_tokens(batch, self._pad_token_id)
        self._pending = tokens if self._pending is None else self._pending + tokens
        # Lightning read the batch size before this hook; reshape changed it, so say it explicitly.
        pl_module.log(f"{_PREFIX}/seq_len", float(seq_len), on_step=True, on_epoch=False, batch_size=self._rows)
        pl_module.log(f"{_PREFIX}/rows", float(self._rows), on_step=True, on_epoch=False, batch_size=self._rows)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_step:
            return  # still inside a gradient-accumulation window
        self._last_step = trainer.global_step
        pending = self._pending if self._pending is not None else torch.zeros((), device=pl_module.device)
        self._pending = None
        # One small all-reduce per optimizer step keeps the count (and a token-budget schedule) equal on all ranks.
        total = trainer.strategy.reduce(pending.to(torch.long), reduce_op="sum")
        self._tokens_seen += int(total.item())
        pl_module.log(
            f"{_PREFIX}/tokens_seen",
            float(self._tokens_seen),
            on_step=True,
            on_epoch=False,
            batch_size=max(self._rows, 1),
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"tokens_seen": self._tokens_seen}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._tokens_seen = int(state_dict.get("tokens_seen", 0))

    # ------------------------------------------------------------------------------------------------ checks

    def _check_against_datamodule(self, trainer: Trainer) -> None:
        if not isinstance(trainer.datamodule, GivesMaxBatchShape):
            return
        try:
            _, length = trainer.datamodule.max_batch_shape()
        except Exception:  # the DataModule cannot tell yet; the per-batch check still applies
            return
        self._warned_long_batch = self._checked_cut = True  # the DataModule answered; no need to look at batches
        if self.duration > 0 and self.min_seq_length < self.max_seq_length and self.min_seq_length >= length:
            rank_zero_warn(
                f"SeqLengthWarmup(min_seq_length={self.min_seq_length}) starts at or above the longest batch the "
                f"DataModule yields ({length} tokens per row): no batch is ever cut, so warmup changes nothing. "
                f"Lower min_seq_length below {length} (and max_seq_length to {length}), or drop the callback."
            )
        elif self.max_seq_length > length:
            rank_zero_warn(
                f"SeqLengthWarmup(max_seq_length={self.max_seq_length}) is longer than the longest batch the "
                f"DataModule yields ({length} tokens): lengths above {length} cut nothing, so that part of warmup is "
                f"wasted. Set max_seq_length={length}."
            )
        elif self.max_seq_length < length:
            what = "are never trained on" if self.truncate else "are reshaped into extra rows"
            rank_zero_warn(
                f"SeqLengthWarmup(max_seq_length={self.max_seq_length}) is shorter than the DataModule's batches "
                f"({length} tokens): even after warmup, tokens past {self.max_seq_length} {what}. Set "
                f"max_seq_length={length} to train at full length after warmup."
            )

    def _warn_nothing_cut(self, batch: Any, seq_len: int) -> None:
        """Without a DataModule that tells its longest batch: at the end of warmup, say so if no batch was longer
        than ``min_seq_length`` (nothing was ever cut)."""
        if self._checked_cut or not isinstance(batch, dict) or self.min_seq_length == self.max_seq_length:
            return
        lengths = [v.shape[-1] for v in batch.values() if isinstance(v, torch.Tensor) and v.ndim == 2]
        self._longest_seen = max([self._longest_seen, *lengths])
        if seq_len < self.max_seq_length or self.duration == 0:
            return
        self._checked_cut = True
        if 0 < self._longest_seen <= self.min_seq_length:
            rank_zero_warn(
                f"SeqLengthWarmup ended without cutting a batch: the longest training batch had {self._longest_seen} "
                f"tokens per row, at or below min_seq_length={self.min_seq_length}, so warmup changed nothing. "
                f"Lower min_seq_length below {self._longest_seen}, or drop the callback."
            )

    def _warn_long_batch(self, batch: Any) -> None:
        if self._warned_long_batch or not isinstance(batch, dict):
            return
        lengths = [v.shape[-1] for v in batch.values() if isinstance(v, torch.Tensor) and v.ndim == 2]
        if lengths and max(lengths) > self.max_seq_length:
            self._warned_long_batch = True
            what = "are never trained on" if self.truncate else "are reshaped into extra rows"
            rank_zero_warn(
                f"SeqLengthWarmup(max_seq_length={self.max_seq_length}) got a training batch of {max(lengths)} tokens "
                f"per row: even after warmup, tokens past {self.max_seq_length} {what}. Set max_seq_length to the "
                "longest sequence your loader yields."
            )
