"""The batch contract: the keys every loader yields, the ignore index, and what counts as a real token.

One owner for these facts: collators, the model, ``TokenEfficiency``, the warmup transform and callback, the job
record and the pre-allocator import them from here instead of retyping ``-100`` or their own padding test.
Torch only, no Lightning import.

Every batch is a ``dict[str, torch.Tensor]`` of ``[batch, seq]`` tensors (see ``ARCHITECTURE.md``):

- pad and truncate layouts: :data:`PAD_KEYS` (``attention_mask`` 1 = real token, ``labels`` -100 on padding);
- pack layout: :data:`PACK_KEYS` (no ``attention_mask``; ``position_ids`` restart at 0 per document, each
  document's first label and every padding label is -100), plus the optional 1-D int32 :data:`CU_SEQLENS`.

Labels are unshifted (Hugging Face models shift them), so the tokens a batch trains on are ``labels[:, 1:]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = [
    "COMPLETION_MASK",
    "CU_SEQLENS",
    "IGNORE_INDEX",
    "PACK_KEYS",
    "PAD_KEYS",
    "PREFERENCE_PACK_KEYS",
    "PREFERENCE_PAD_KEYS",
    "REF_LOGPS_KEYS",
    "SEQUENCE_INDEX",
    "SOURCE_INDEX",
    "Layout",
    "count_label_tokens",
    "default_layout",
    "full_rows",
    "packed_rows",
    "padded_rows",
    "count_real_tokens",
    "real_token_mask",
]

IGNORE_INDEX = -100
"""Label of a slot the loss skips: padding, a packed document's first token, a prompt under completion-only loss."""

PAD_KEYS = ("input_ids", "attention_mask", "labels")
"""Keys of a padded or truncated batch."""

PACK_KEYS = ("input_ids", "labels", "position_ids")
"""Keys of a packed batch (no ``attention_mask``: ``position_ids`` keep the documents apart)."""

CU_SEQLENS = "cu_seqlens"
"""Optional key of packed batches: 1-D int32 cumulative segment lengths over the flattened batch."""

COMPLETION_MASK = "completion_mask"
"""Preference pairs: ``[batch, seq]`` mask of completion tokens (1) against prompt and padding (0)."""

SEQUENCE_INDEX = "sequence_index"
"""Packed preference pairs: ``[batch, seq]`` index of each token's sequence in the batch, -1 on padding."""

REF_LOGPS_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
"""Optional precomputed reference log-probabilities of a pair, passed through as 1-D ``[pairs]`` tensors (TRL's)."""

SOURCE_INDEX = "source_index"
"""Validation batches of a ``Mix``: 1-D ``[rows]`` index of the source (``NamesSources.source_names``) of each row;
a batch holds one source. Never in training batches."""

PREFERENCE_PAD_KEYS = ("input_ids", "attention_mask", COMPLETION_MASK, "labels")
"""Keys of a padded pair batch ``[2B, L]``, chosen rows then rejected rows (TRL's three, plus unshifted ``labels``,
-100 off the completions)."""

PREFERENCE_PACK_KEYS = ("input_ids", "labels", "position_ids", COMPLETION_MASK, SEQUENCE_INDEX)
"""Keys of a packed pair batch (no ``attention_mask``: ``position_ids`` keep the sequences apart)."""


def real_token_mask(batch: Mapping[str, torch.Tensor], pad_token_id: int | None = None) -> torch.Tensor:
    """Which slots hold real (document) tokens, not padding: ``BoolTensor[batch, seq]``.

    Decided from what the batch carries, most precise first:

    1. ``attention_mask`` (pad / truncate layouts): its non-zero slots; packed pairs: ``sequence_index >= 0``.
    2. ``labels`` and a known ``pad_token_id`` (pack layout): a slot is padding only when it holds the pad id *and*
       the loss ignores it, since a real token may equal the pad id (e.g. EOS used for padding).
    3. ``labels`` without a pad id: the slots the loss reads (``labels != -100``); a packed document's first token
       and ignored prompts then count as padding, so pass ``pad_token_id`` where you know it.
    4. Nothing to tell padding apart: every slot counts.

    Args:
        batch: dict of ``[batch, seq]`` tensors following the batch contract.
        pad_token_id: the tokenizer's padding id; ``None`` when unknown.

    Example::

        >>> real_token_mask({"input_ids": torch.tensor([[5, 0]]), "attention_mask": torch.tensor([[1, 0]])}).tolist()
        [[True, False]]
    """
    if "attention_mask" in batch:
        return batch["attention_mask"].bool()
    if SEQUENCE_INDEX in batch:  # packed preference pairs say which sequence every slot holds (-1: padding)
        return batch[SEQUENCE_INDEX] >= 0
    if "labels" in batch:
        ignored = batch["labels"] == IGNORE_INDEX
        if pad_token_id is None or "input_ids" not in batch:
            return ~ignored
        return ~((batch["input_ids"] == pad_token_id) & ignored)
    slots = (
        batch["input_ids"]
        if "input_ids" in batch
        else next(v for k, v in batch.items() if isinstance(v, torch.Tensor) and v.ndim == 2 and k != CU_SEQLENS)
    )
    return torch.ones_like(slots, dtype=torch.bool)


def count_real_tokens(batch: Mapping[str, torch.Tensor], pad_token_id: int | None = None) -> torch.Tensor:
    """Number of real tokens in a batch (:func:`real_token_mask`), a 0-d long tensor on the batch's device.

    A tensor, not an int, so a caller on the GPU (the warmup callback) can sum it without a host sync; ``int(...)``
    it for a Python number.

    Example::

        >>> batch = {"input_ids": torch.tensor([[5, 6, 0]]), "labels": torch.tensor([[-100, 6, -100]])}
        >>> int(count_real_tokens(batch, pad_token_id=0))  # the first token of a packed document is real
        2
    """
    return real_token_mask(batch, pad_token_id).sum()


def count_label_tokens(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Number of tokens the loss predicts: ``labels[:, 1:] != -100`` (labels are shifted by the model), 0-d long.

    The weight of a batch in a per-token mean loss.

    Example::

        >>> int(count_label_tokens({"labels": torch.tensor([[5, 6, 7, -100]])}))  # 6 and 7 are predicted
        2
    """
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


# Worst-case layouts: per row, the lengths of its documents (the rest of the row is padding). The layout decides
# which attention path transformers takes (no mask, a padding mask, a block-diagonal mask), so a batch built for
# its memory must have the layout as well as the shape (memory.worst_batch builds it; strategies choose it).
Layout = tuple[tuple[int, ...], ...]  # per row, the lengths of its documents; the rest of the row is padding


def full_rows(rows: int, length: int) -> Layout:
    """Every row one document filling it (no padding, no packing): the mask-free attention path."""
    return ((length,),) * rows


def padded_rows(rows: int, length: int) -> Layout:
    """Full rows but the last, which ends with one padding slot: the padded path (``attention_mask`` has a 0)."""
    if length < 2:
        return full_rows(rows, length)
    return ((length,),) * (rows - 1) + ((length - 1,),)


def packed_rows(rows: int, length: int) -> Layout:
    """Two documents per row, position_ids restarting at the second: the packed path (block-diagonal mask)."""
    if length < 2:
        return full_rows(rows, length)
    return ((length // 2, length - length // 2),) * rows


def default_layout(rows: int, length: int, keys: Sequence[str]) -> Layout:
    """The layout the batch contract's keys allow that costs the most: padded rows when there is an
    ``attention_mask``, packed rows when there are ``position_ids`` without one, else full rows."""
    if "attention_mask" in keys:
        return padded_rows(rows, length)
    if "position_ids" in keys:
        return packed_rows(rows, length)
    return full_rows(rows, length)
