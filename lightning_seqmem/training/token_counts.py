"""What a training run has fed the model, counted where it happens: real tokens, slots, seconds in training batches.

Mixed into ``CausalLM`` (and so ``DPO``); ``apps.summary.RunSummary`` reads it through
``protocols.CountsTrainingTokens`` and sums the ranks.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from lightning_seqmem.batch import count_real_tokens
from lightning_seqmem.training.metrics import RankCount, TokenEfficiency


class TrainingTokenCounts:
    """Counts of the training batches, this rank's: call ``_init_token_counts`` in ``__init__`` and
    ``_count_train_tokens`` in ``training_step``; batch timing comes from the batch hooks."""

    def _init_token_counts(self, pad_token_id: int | None) -> None:
        # Real tokens / slots, summed over ranks; the pad id is set again at setup once the tokenizer is known.
        self.token_efficiency = TokenEfficiency(pad_token_id=pad_token_id)
        # Real tokens trained on, this rank: a device counter (not a buffer, which DDP would overwrite with rank
        # 0's before each forward), read on the host only when asked (real_tokens_seen).
        self._real_tokens = RankCount()
        self.slots_seen = 0
        self._train_time = 0.0
        self._batch_start: float | None = None

    @property
    def real_tokens_seen(self) -> int:
        """Real tokens trained on so far, this rank (reads the device counter: one sync)."""
        return int(self._real_tokens.total)

    @property
    def train_seconds(self) -> float:
        """Wall-clock seconds spent in training batches so far, this rank (``protocols.CountsTrainingTokens``)."""
        return self._train_time

    def _count_train_tokens(self, batch: dict[str, torch.Tensor], rows: int) -> tuple[torch.Tensor, int]:
        """``(real, slots)`` of a batch, added to the counts and logged: the step's real-token fraction, the real
        tokens seen so far, token efficiency and tokens/s (on the device: no sync). Logged here, so every module
        that counts (``CausalLM``, ``DPO``) logs the same names."""
        real, slots = count_real_tokens(batch, self.hparams.pad_token_id), batch["input_ids"].numel()
        self._real_tokens.update(real)
        self.slots_seen += slots
        self.token_efficiency.update(batch, real_tokens=real)
        self.log("train/real_token_fraction", real / max(slots, 1), batch_size=rows)
        self.log("train/real_tokens_seen", self._real_tokens.total.float(), batch_size=rows, reduce_fx="max")
        self.log("train/token_efficiency", self.token_efficiency, batch_size=rows, on_step=False, on_epoch=True)
        if self._train_time > 0:
            per_s = self._real_tokens.total / self._train_time
            self.log("train/real_tokens_per_sec", per_s, prog_bar=True, batch_size=rows)
        return real, slots

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._batch_start is not None:
            self._train_time += time.perf_counter() - self._batch_start
