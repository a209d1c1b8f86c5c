"""Sequence-length warmup: the batch transform.

A pure function on a dict of ``[batch, seq]`` tensors (the batch contract of ``ARCHITECTURE.md``), with the
contract of Composer's ``set_batch_sequence_length``: it either truncates every row to ``curr_seq_len`` or
reshapes the batch into more rows of ``curr_seq_len`` tokens. No Lightning import.

Beyond Composer, reshape keeps documents apart: every new row starts a new segment (``position_ids`` restart at 0
for packed batches) whose first label is ``-100``, so no token predicts or attends to another row's document, and
rows made only of padding are dropped.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

from lightning_seqmem.batch import CU_SEQLENS, IGNORE_INDEX, REF_LOGPS_KEYS, real_token_mask
from lightning_seqmem.training.varlen import cu_seqlens
from lightning_seqmem.warmup.pairs import is_pair_batch, truncate_pairs

__all__ = ["reshaped_batch_shape", "set_batch_sequence_length"]


def set_batch_sequence_length(
    batch: MutableMapping[str, torch.Tensor],
    curr_seq_len: int,
    truncate: bool = True,
    preserve_end_of_sequence: bool = False,
    pad_token_id: int | None = None,
) -> MutableMapping[str, torch.Tensor]:
    """Cut a batch to ``curr_seq_len`` tokens per row, in place.

    Every value that is a 2-D tensor ``[batch, seq]`` is changed; other values are left alone, except the
    optional 1-D ``cu_seqlens`` of packed batches, which is recomputed from the new ``position_ids`` (or dropped
    when the batch has none). A batch no longer than ``curr_seq_len`` is returned untouched.

    Preference pair batches (``completion_mask``) are truncated so that both sequences of a pair are cut alike, with
    ``curr_seq_len`` a sequence length (``warmup.pairs.truncate_pairs``); reshape is refused for them.

    Packed batches (``position_ids`` and no ``attention_mask``) are handled in both modes: truncation keeps a
    prefix of every row, so segments stay consistent; reshape restarts ``position_ids`` at 0 and sets the label to
    ``-100`` wherever a new row starts in the middle of a segment.

    Args:
        batch: dict of ``[batch, seq]`` tensors, e.g. ``input_ids``, ``attention_mask``, ``labels``,
            ``position_ids``. Changed in place and returned.
        curr_seq_len: the sequence length to cut to, ``>= 1``.
        truncate: ``True`` cuts every row to ``[batch, curr_seq_len]`` (tokens past it are lost). ``False``
            reshapes: all tensors are flattened in row order and cut into rows of ``curr_seq_len``, at most
            ``curr_seq_len - 1`` tokens are dropped from the end, and rows made only of padding are dropped.
        preserve_end_of_sequence: with ``truncate=True``, write each row's last real token (e.g. EOS, found with
            ``attention_mask``) into its last kept position, in every 2-D tensor.
        pad_token_id: lets reshape recognise padding in packed batches (``input_ids == pad_token_id`` and
            ``labels == -100``). Without it, a packed row counts as padding when none of its labels is trained on.

    Returns:
        The same dict object, with new tensors.

    Raises:
        TypeError: ``batch`` is not a dict, or ``curr_seq_len`` is not an int.
        ValueError: ``curr_seq_len < 1``; a tensor is neither 2-D nor ``cu_seqlens``; reshape with 2-D tensors of
            different shapes; ``preserve_end_of_sequence`` without ``attention_mask`` or with ``truncate=False``.

    Example::

        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}  # [50, 128]
        set_batch_sequence_length(batch, 64)  # now [50, 64]
        set_batch_sequence_length(batch, 8, truncate=False)  # [400, 8], same tokens, same order
    """
    shape = _check_batch(batch, curr_seq_len)
    if is_pair_batch(batch):  # preference pairs: both sequences of a pair cut alike (warmup/pairs.py)
        return truncate_pairs(batch, curr_seq_len, truncate, pad_token_id)
    if preserve_end_of_sequence and not truncate:
        raise ValueError(
            "preserve_end_of_sequence=True only applies to truncate=True (reshape keeps every token); "
            "set truncate=True or preserve_end_of_sequence=False."
        )
    if preserve_end_of_sequence and "attention_mask" not in batch:
        raise ValueError(
            "preserve_end_of_sequence=True finds each row's last real token with `attention_mask`, which this batch "
            f"lacks (keys: {sorted(batch)}). Packed batches have none: use preserve_end_of_sequence=False, or add an "
            "`attention_mask` (1 = real token) to the batch."
        )
    if not truncate:
        _check_same_shape(batch)
    if shape[1] <= curr_seq_len:
        return batch
    if truncate:
        _truncate(batch, curr_seq_len, preserve_end_of_sequence)
    else:
        _reshape(batch, curr_seq_len, pad_token_id)
    _fix_cu_seqlens(batch)
    return batch


def reshaped_batch_shape(rows: int, length: int, curr_seq_len: int, truncate: bool) -> tuple[int, int]:
    """Largest shape :func:`set_batch_sequence_length` makes of a ``[rows, length]`` batch (before rows of padding
    are dropped, which only makes it smaller).

    Example::

        reshaped_batch_shape(4, 128, 32, truncate=False)  # (16, 32)
    """
    if length <= curr_seq_len:
        return rows, length
    if truncate:
        return rows, curr_seq_len
    return rows * length // curr_seq_len, curr_seq_len


# --------------------------------------------------------------------------------------------------- checks


def _check_batch(batch: object, curr_seq_len: int) -> tuple[int, int]:
    if not isinstance(batch, MutableMapping):
        raise TypeError(
            f"Sequence-length warmup needs a dict batch of [batch, seq] tensors, got {type(batch).__name__}. "
            "Return a dict such as {'input_ids': ..., 'attention_mask': ..., 'labels': ...} from your collate_fn "
            "(the DataModule's collators already do)."
        )
    if isinstance(curr_seq_len, bool) or not isinstance(curr_seq_len, int):
        raise TypeError(f"curr_seq_len must be an int, got {curr_seq_len!r}.")
    if curr_seq_len < 1:
        raise ValueError(f"curr_seq_len must be >= 1, got {curr_seq_len}.")
    shape = None
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or key == CU_SEQLENS or key in REF_LOGPS_KEYS:
            continue
        if value.ndim != 2:
            raise ValueError(
                f"Sequence-length warmup cuts [batch, seq] tensors, but batch[{key!r}] has shape {tuple(value.shape)}. "
                "Give every per-token tensor a batch dimension (e.g. `x.unsqueeze(0)` for a single sequence) and keep "
                "per-example values out of the batch dict."
            )
        if shape is None or value.shape[1] > shape[1]:
            shape = tuple(value.shape)
    if shape is None:
        raise ValueError(
            f"The batch holds no [batch, seq] tensor (keys: {sorted(batch)}); sequence-length warmup has nothing to "
            "cut. Put `input_ids` in the batch dict."
        )
    return shape


def _check_same_shape(batch: MutableMapping[str, torch.Tensor]) -> None:
    shapes = {k: tuple(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor) and k != CU_SEQLENS}
    if len(set(shapes.values())) > 1:
        raise ValueError(
            f"Reshape (truncate=False) needs every [batch, seq] tensor to have the same shape, got {shapes}. Pad them "
            "to the same shape in your collate_fn, or use truncate=True."
        )


# ------------------------------------------------------------------------------------------------ truncate


def _truncate(batch: MutableMapping[str, torch.Tensor], curr_seq_len: int, preserve_end_of_sequence: bool) -> None:
    keys = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.ndim == 2 and k != CU_SEQLENS]
    if not preserve_end_of_sequence:
        for key in keys:
            batch[key] = batch[key][:, :curr_seq_len].contiguous()
        return
    mask = batch["attention_mask"].bool()
    columns = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, columns, -1).amax(dim=1)  # last real token per row; -1 for an empty row
    rows = torch.nonzero(last >= curr_seq_len).squeeze(1)  # only rows whose last real token is cut off
    last, target = last[rows], torch.full_like(rows, curr_seq_len - 1)
    for key in keys:
        value = batch[key]
        end_values = value[rows, last]
        value = value[:, :curr_seq_len].contiguous()
        value[rows, target] = end_values
        batch[key] = value


# ------------------------------------------------------------------------------------------------- reshape


def _reshape(batch: MutableMapping[str, torch.Tensor], curr_seq_len: int, pad_token_id: int | None) -> None:
    first = _first_2d(batch)  # every 2-D tensor has this shape (checked)
    (rows, length), device = first.shape, first.device
    keep = rows * length // curr_seq_len * curr_seq_len
    flat_index = torch.arange(keep, device=device)
    # Segment starts that reshape creates: every new row, and every old row (a row may start mid-document).
    forced_start = (flat_index % curr_seq_len == 0) | (flat_index % length == 0)
    if "attention_mask" in batch:
        # Left padding: a document starts at the first real token of its row, not at column 0.
        mask = batch["attention_mask"].bool()
        first_real = mask.float().argmax(dim=1) + torch.arange(rows, device=device) * length
        first_real = first_real[mask.any(dim=1) & (first_real < keep)]
        forced_start[first_real] = True

    flat = {k: v.reshape(-1)[:keep] for k, v in batch.items() if isinstance(v, torch.Tensor) and k != CU_SEQLENS}
    if "position_ids" in flat:
        flat["position_ids"] = _restart_positions(flat["position_ids"], forced_start)
    if "labels" in flat:
        flat["labels"] = flat["labels"].masked_fill(forced_start, IGNORE_INDEX)
    for key, value in flat.items():
        batch[key] = value.view(-1, curr_seq_len)

    keep_rows = real_token_mask(batch, pad_token_id).any(dim=1)
    keep_rows[0] |= not bool(keep_rows.any())  # never hand the model an empty batch
    if not bool(keep_rows.all()):
        for key in flat:
            batch[key] = batch[key][keep_rows].contiguous()


def _restart_positions(positions: torch.Tensor, forced_start: torch.Tensor) -> torch.Tensor:
    """Subtract, over each segment that starts at a forced start, the position it starts at: ``[k]`` in and out."""
    natural_start = torch.ones_like(forced_start)
    natural_start[1:] = positions[1:] - positions[:-1] != 1  # how transformers finds packed segments
    start = natural_start | forced_start
    segment = torch.cumsum(start.long(), dim=0) - 1
    starts = torch.nonzero(start).squeeze(1)
    offset = torch.where(forced_start[starts], positions[starts], torch.zeros_like(positions[starts]))
    return positions - offset[segment]


def _fix_cu_seqlens(batch: MutableMapping[str, torch.Tensor]) -> None:
    if CU_SEQLENS not in batch:
        return
    old = batch.pop(CU_SEQLENS)
    if "position_ids" not in batch:
        return
    dtype = old.dtype if isinstance(old, torch.Tensor) else torch.int32
    batch[CU_SEQLENS] = cu_seqlens(batch["position_ids"]).to(dtype)  # the rule flash varlen and the masks use


# ------------------------------------------------------------------------------------------------- helpers


def _first_2d(batch: MutableMapping[str, torch.Tensor]) -> torch.Tensor:
    return next(v for k, v in batch.items() if isinstance(v, torch.Tensor) and k != CU_SEQLENS)
