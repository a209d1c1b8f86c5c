"""``val/loss/<name>`` for each source of a ``Mix``, beside the token-weighted ``val/loss`` of them all.

A mixed DataModule's validation batches hold one source each and say which (``batch.SOURCE_INDEX``); the loss of a
batch (what ``validation_step`` returns) is weighted by its predicted tokens, as ``val/loss`` is, so each source's
value is its own per-token loss and ``val/loss`` stays the total over every source's validation tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics import MeanMetric

from lightning_seqmem.batch import SOURCE_INDEX, count_label_tokens
from lightning_seqmem.protocols import NamesSources


class SourceLosses:
    """Mixed into ``CausalLM``: logs ``val/loss/<name>`` per source from the loss ``validation_step`` returns.

    Every rank reads batches of every source in the same order (``datamodule.mix_mode.SourceBatches``), so every
    rank logs the same metrics and their sync at the epoch's end cannot hang.
    """

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if not isinstance(batch, dict) or SOURCE_INDEX not in batch or not isinstance(outputs, torch.Tensor):
            return
        index = int(batch[SOURCE_INDEX][0])
        name = self._source_name(index)
        metrics = getattr(self, "_source_losses", None)
        if metrics is None:
            metrics = self._source_losses = torch.nn.ModuleDict()  # a submodule: moves with the model
        if name not in metrics:
            metrics[name] = MeanMetric().to(outputs.device)
        metrics[name].update(outputs.detach(), weight=count_label_tokens(batch))
        rows = batch["input_ids"].shape[0]  # metric_attribute: made after Lightning listed the model's metrics
        self.log(f"val/loss/{name}", metrics[name], batch_size=rows, metric_attribute=f"_source_losses.{name}")

    def _source_name(self, index: int) -> str:
        """The source's name from the DataModule (``protocols.NamesSources``), else ``source_<index>``."""
        dm = getattr(self.trainer, "datamodule", None)
        names = dm.source_names() if isinstance(dm, NamesSources) else ()
        return names[index] if index < len(names) else f"source_{index}"
