"""``TokenEfficiency``: the fraction of the slots fed to the model that hold real tokens, not padding."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torchmetrics import Metric

from lightning_seqmem.batch import count_real_tokens


class TokenEfficiency(Metric):
    """Real tokens / slots, accumulated over batches and summed over DDP ranks before dividing.

    Sums (not per-batch ratios) are synced, so the value is exact under DDP and with batches of different shapes.

    Args:
        pad_token_id: the padding id, used to tell padding from real tokens in packed batches (no attention mask);
            see :func:`lightning_seqmem.batch.real_token_mask` for what counts without it.

    Example::

        >>> m = TokenEfficiency(pad_token_id=0)
        >>> m.update({"input_ids": torch.tensor([[5, 6, 0, 0]]), "attention_mask": torch.tensor([[1, 1, 0, 0]])})
        >>> m.compute()
        tensor(0.5000)
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, pad_token_id: int | None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.pad_token_id = pad_token_id
        self.add_state("real_tokens", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("slots", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, batch: Mapping[str, torch.Tensor], real_tokens: torch.Tensor | None = None) -> None:
        """Count one batch dict (``input_ids`` ``[batch, seq]`` plus ``attention_mask`` or ``labels``).

        Args:
            batch: the batch dict.
            real_tokens: its ``count_real_tokens``, when the caller has it already (no second count).
        """
        self.real_tokens += count_real_tokens(batch, self.pad_token_id) if real_tokens is None else real_tokens
        self.slots += batch["input_ids"].numel()

    def compute(self) -> torch.Tensor:
        return self.real_tokens.float() / self.slots.clamp(min=1).float()


class RankCount(Metric):
    """A running count kept on the device, this rank's own (``CausalLM.real_tokens_seen``), read when asked.

    A metric state rather than a module buffer: DDP copies rank 0's buffers into every rank before each forward,
    which made every rank report rank 0's count plus its own last batch. As a metric state it moves with the module
    and a throw-away step's count is undone (``memory.untouched``), as before.
    """

    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, count: torch.Tensor) -> None:
        self.total += count

    def compute(self) -> torch.Tensor:
        """The count summed over the ranks (``total`` is this rank's)."""
        return self.total
