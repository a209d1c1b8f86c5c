"""Sequence-length warmup on preference pair batches: truncation that cuts both sequences of a pair alike.

Pair batches (``completion_mask`` in the batch) carry their pairing in the layout: padded ones row ``k`` (chosen)
with row ``P + k`` (rejected), packed ones through ``sequence_index``. ``curr_seq_len`` is a *sequence* length here,
as ``max_length`` is for pairs:

- padded ``[2B, L]``: every row cut at column ``curr_seq_len``, so a pair's two sequences are cut at the same column
  (the plain truncation already does this);
- packed ``[B, 2 * max_length]``: every sequence keeps its first ``curr_seq_len`` tokens (``position_ids <
  curr_seq_len``), the kept tokens close up to the left of their row (whole pairs stay in their row), and the batch
  is cut to its longest row; ``sequence_index`` keeps every sequence's number (a sequence always keeps its first
  token), the freed slots become padding (pad id, label -100, ``completion_mask`` 0, ``sequence_index`` -1).

Reshape (``truncate=False``) is refused: folding rows into more rows would separate the sequences of a pair.
``[pairs]`` values (precomputed reference log-probabilities) are left alone. No Lightning import.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

from lightning_seqmem.batch import COMPLETION_MASK, CU_SEQLENS, IGNORE_INDEX, SEQUENCE_INDEX
from lightning_seqmem.training.varlen import cu_seqlens


def is_pair_batch(batch: MutableMapping[str, torch.Tensor]) -> bool:
    """Whether ``batch`` is a preference pair batch (padded or packed)."""
    return COMPLETION_MASK in batch


def truncate_pairs(
    batch: MutableMapping[str, torch.Tensor], curr_seq_len: int, truncate: bool = True, pad_token_id: int | None = None
) -> MutableMapping[str, torch.Tensor]:
    """Cut every sequence of a pair batch to ``curr_seq_len`` tokens, in place (see the module docstring).

    Args:
        batch: a padded or packed pair batch; changed in place and returned.
        curr_seq_len: the sequence length to cut to, ``>= 1``.
        truncate: must be ``True`` (reshape would split pairs).
        pad_token_id: written into the freed slots of packed rows (0 when unknown).

    Raises:
        ValueError: ``truncate=False``.

    Example::

        set_batch_sequence_length(packed_pairs, 16)  # every sequence keeps its first 16 tokens, pairs intact
    """
    if not truncate:
        raise ValueError(
            "Sequence-length warmup with truncate=False reshapes rows into more rows, which would "
            "separate the chosen and rejected sequences of preference pairs; use truncate=True."
        )
    if SEQUENCE_INDEX not in batch:
        if batch["input_ids"].shape[1] > curr_seq_len:
            for key, value in list(batch.items()):
                if isinstance(value, torch.Tensor) and value.ndim == 2:
                    batch[key] = value[:, :curr_seq_len].contiguous()
        return batch
    positions, index = batch["position_ids"], batch[SEQUENCE_INDEX]
    keep = (index >= 0) & (positions < curr_seq_len)
    if bool((keep == (index >= 0)).all()):
        return batch  # no sequence is longer than curr_seq_len
    kept = keep.sum(dim=1)
    length = max(int(kept.max()), 1)
    # Target column of each kept token: its rank among its row's kept tokens.
    column = torch.cumsum(keep.long(), dim=1) - 1
    rows = torch.arange(keep.shape[0], device=keep.device)[:, None].expand_as(keep)
    fills = {"input_ids": pad_token_id or 0, "labels": IGNORE_INDEX, COMPLETION_MASK: 0, SEQUENCE_INDEX: -1}
    for key, value in list(batch.items()):
        if not isinstance(value, torch.Tensor) or value.ndim != 2:
            continue
        out = torch.full((value.shape[0], length), fills.get(key, 0), dtype=value.dtype, device=value.device)
        out[rows[keep], column[keep]] = value[keep]
        batch[key] = out
    # The freed tail of each row is a padding segment of its own: positions 0, 1, 2, ... (the pack layout).
    slots = torch.arange(length, device=keep.device)[None, :]
    tail = slots >= kept[:, None]
    batch["position_ids"] = torch.where(tail, slots - kept[:, None], batch["position_ids"])
    if CU_SEQLENS in batch:
        batch[CU_SEQLENS] = cu_seqlens(batch["position_ids"]).to(batch[CU_SEQLENS].dtype)
    return batch
