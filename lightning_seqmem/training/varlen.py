"""Flash-attention varlen arguments for packed batches, computed from ``position_ids``.

transformers infers packed-document boundaries from ``position_ids`` only when a batch has ONE row; a packed
``[rows > 1, seq]`` batch runs plain causal flash attention over each whole row, so documents sharing a row attend
to each other. Passing ``cu_seq_lens_q/k`` and ``max_length_q/k`` (over the flattened ``[rows * seq]`` batch)
makes every flash path (``flash_attention_2``, ``flash_attention_3``, hub kernels) run varlen attention, one
segment per document, with no reshaping: transformers flattens the rows itself. SDPA and eager need nothing: they
build a block-diagonal mask from the same ``position_ids``.

One line in a LightningModule's step::

    out = model(**batch, **flash_varlen_kwargs(batch["position_ids"]))

Each call waits for the device once (the segment count and the longest segment are data-dependent): at the start of
a step that costs one kernel launch of idle time, not a pipeline drain. :func:`batch_varlen_kwargs` gives the same
arguments for a batch dict, padded rows included (each run of padding its own segment), for ``torch_varlen``
(:mod:`lightning_seqmem.training.attention`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@runtime_checkable
class PassesFlashVarlen(Protocol):
    """A module that passes :func:`flash_varlen_kwargs` to its model on packed batches (``CausalLM`` does); a
    user's own LightningModule says so with the class attribute ``passes_flash_varlen_kwargs = True``, which
    ``ConfigChecks`` reads."""

    passes_flash_varlen_kwargs: bool


TORCH_VARLEN = "torch_varlen"  # torch's own varlen flash kernel (lightning_seqmem.training.attention)


def is_flash_attention(attn_implementation: str | None) -> bool:
    """Whether an ``attn_implementation`` name is a flash-attention kernel that takes the varlen arguments
    (``flash_attention_2``/``_3``/``_4``, a hub kernel such as ``"kernels-community/flash-attn2"``, or
    ``torch_varlen``, torch's own)."""
    return isinstance(attn_implementation, str) and (
        "flash" in attn_implementation.lower() or attn_implementation == TORCH_VARLEN
    )


def segment_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` bool: where a segment (document) starts.

    A segment starts at every row start and wherever the position does not follow the previous one by 1: the rule
    transformers' SDPA/eager masks use (``masking_utils.find_packed_sequence_indices``), so flash attention
    separates exactly the same documents. For packed batches that is where ``position_ids == 0``.
    """
    if position_ids.ndim != 2:
        raise ValueError(f"position_ids must be [batch, seq]; got shape {tuple(position_ids.shape)}.")
    start = torch.ones_like(position_ids, dtype=torch.bool)
    start[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    return start


def cu_seqlens(position_ids: torch.Tensor) -> torch.Tensor:
    """``[segments + 1]`` int32 cumulative segment offsets over the flattened ``[batch * seq]`` batch.

    Example::

        cu_seqlens(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]))  # tensor([0, 3, 5, 7, 10], dtype=int32)
    """
    return _offsets(segment_starts(position_ids))


def _offsets(starts: torch.Tensor) -> torch.Tensor:
    """``[segments + 1]`` int32 offsets of the ``True`` places of a ``[batch, seq]`` start mask, over the flattened
    batch, ending with its size."""
    flat = torch.nonzero(starts.reshape(-1)).squeeze(1)
    total = torch.tensor([starts.numel()], device=starts.device)
    return torch.cat([flat, total]).to(torch.int32)


def _varlen_kwargs(cu: torch.Tensor) -> dict[str, torch.Tensor | int]:
    longest = int((cu[1:] - cu[:-1]).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def flash_varlen_kwargs(position_ids: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """The varlen keyword arguments a Hugging Face model passes to its flash-attention kernels.

    Computed from the batch's own ``position_ids``, so they stay right after anything that reshapes the batch
    (the warmup callback). ``max_length_*`` is a python int (flash kernels take it as a host integer; one device
    sync per step, not one per layer).

    Args:
        position_ids: ``[batch, seq]`` positions restarting at 0 for every packed document.

    Returns:
        ``{"cu_seq_lens_q", "cu_seq_lens_k"}``: ``[segments + 1]`` int32; ``{"max_length_q", "max_length_k"}``: int.

    Example::

        out = model(**batch, **flash_varlen_kwargs(batch["position_ids"]))
    """
    return _varlen_kwargs(cu_seqlens(position_ids))


def batch_segment_starts(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[batch, seq]`` bool: where a segment starts in a batch dict: at every row start, where ``position_ids`` do
    not follow by 1 (a packed document), and where ``attention_mask`` changes value (a run of padding, left or
    right, is a segment of its own that no real token attends to)."""
    if batch.get("position_ids") is not None:
        start = segment_starts(batch["position_ids"])  # row starts included
    else:
        start = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
        start[:, 0] = True
    if batch.get("attention_mask") is not None:
        mask = batch["attention_mask"]
        start[:, 1:] |= mask[:, 1:] != mask[:, :-1]
    return start


def batch_varlen_kwargs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | int]:
    """:func:`flash_varlen_kwargs` for a batch dict, from :func:`batch_segment_starts` (packed documents and runs of
    padding); the same arguments as :func:`flash_varlen_kwargs` for a packed batch.

    Example::

        batch = {"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 1, 0],
                 [1, 1, 1, 1]])}
        batch_varlen_kwargs(batch)["cu_seq_lens_q"]  # tensor([0, 3, 4, 8], dtype=torch.int32)
    """
    return _varlen_kwargs(_offsets(batch_segment_starts(batch)))


def needs_varlen_kwargs(attn_implementation: str | None, inputs: dict[str, torch.Tensor]) -> bool:
    """Whether a model running ``attn_implementation`` needs the varlen arguments for ``inputs``: flash on a packed
    batch (to keep documents apart); ``torch_varlen`` for every batch with documents or padding (transformers builds
    no mask for it)."""
    if attn_implementation == TORCH_VARLEN:
        return "position_ids" in inputs or "attention_mask" in inputs
    packed = "position_ids" in inputs and "attention_mask" not in inputs
    return packed and is_flash_attention(attn_implementation)
