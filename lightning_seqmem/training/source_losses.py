"""``val/loss/<name>`` for each source of a ``Mix``, beside the token-weighted ``val/loss`` of them all.

A mixed DataModule's validation batches hold one source each and say which (``batch.SOURCE_INDEX``); the loss of a
batch (what ``validation_step`` returns) is weighted by its predicted tokens, as ``val/loss`` is, so each source's
value is its own per-token loss and ``val/loss`` stays the total over every source's validation tokens (``DPO``
weighs by pairs: its loss is a mean over pairs).

The sums stay on the device, indexed by the batch's source tensor (:class:`SourceMeans`): no batch waits for the
device to tell the host its source; the host reads them once, at the epoch's end.
"""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics import Metric

from lightning_seqmem.batch import SOURCE_INDEX, count_label_tokens
from lightning_seqmem.protocols import NamesSources


class SourceMeans(Metric):
    """Token-weighted mean loss per source: ``[sources]`` sums of ``loss * tokens`` and of ``tokens``, summed over
    ranks at ``compute``."""

    full_state_update = False

    def __init__(self, sources: int) -> None:
        super().__init__()
        self.add_state("sums", torch.zeros(sources, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("weights", torch.zeros(sources, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, source: torch.Tensor, loss: torch.Tensor, tokens: torch.Tensor) -> None:
        """``source``: the batch's source index (a 1-element tensor, on the device); ``loss`` its mean loss."""
        index = source.reshape(1).long()
        self.sums.index_add_(0, index, (loss.detach().double() * tokens).reshape(1))
        self.weights.index_add_(0, index, tokens.double().reshape(1))

    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-source means (0 where a source had no tokens) and the token counts."""
        return self.sums / self.weights.clamp(min=1), self.weights


class SourceLosses:
    """Mixed into ``CausalLM``: logs ``val/loss/<name>`` per source from the loss ``validation_step`` returns.

    Every rank reads batches of every source in the same order (``datamodule.mix_mode.SourceBatches``), so every
    rank logs the same metrics and their sync at the epoch's end cannot hang.
    """

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if not isinstance(batch, dict) or SOURCE_INDEX not in batch or not isinstance(outputs, torch.Tensor):
            return
        names = self._source_names()
        metric = getattr(self, "_source_losses", None)
        if metric is None or metric.sums.numel() < len(names):
            metric = self._source_losses = SourceMeans(len(names)).to(outputs.device)  # a submodule: moves along
        metric.update(batch[SOURCE_INDEX][:1], outputs, self._source_loss_weight(batch))

    def _source_loss_weight(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """What the loss ``validation_step`` returns is a mean over, on the device: the predicted tokens here (a
        module whose loss is a mean over something else, ``DPO``'s pairs, says so)."""
        return count_label_tokens(batch)

    def log_source_losses(self) -> None:
        """At the validation epoch's end: each source's loss (summed over ranks), then the sums start again."""
        metric = getattr(self, "_source_losses", None)
        if metric is None or not metric.update_called:
            return
        means, weights = metric.compute()
        names = self._source_names()
        for index, seen in enumerate((weights > 0).tolist()):  # the one host read of the epoch
            if seen:
                # Already summed over the ranks, the same on each: sync_dist averages equal values (one small
                # all-reduce at the epoch's end) and keeps Lightning from warning that an epoch value is unsynced.
                self.log(f"val/loss/{names[index]}", means[index].float(), sync_dist=True)
        metric.reset()

    def _source_names(self) -> tuple[str, ...]:
        """The sources' names from the DataModule (``protocols.NamesSources``)."""
        dm = getattr(self.trainer, "datamodule", None)
        if not isinstance(dm, NamesSources):
            raise ValueError(
                f"Validation batches carry {SOURCE_INDEX!r} but the DataModule ({type(dm).__name__}) does not name its "
                "sources: give it a source_names() method (protocols.NamesSources), or leave the key out of the batch."
            )
        return tuple(dm.source_names())
