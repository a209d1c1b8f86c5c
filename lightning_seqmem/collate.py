"""Collators: lists of tokenized examples to the batch dicts of the batch contract (see ARCHITECTURE.md).

Every collator returns ``dict[str, torch.Tensor]`` with 2-D ``[batch, seq]`` long tensors. Collators hold no
counters: they run in dataloader workers, so truncation is counted at dataset level (``truncation.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_seqmem.batch import IGNORE_INDEX, real_token_mask  # noqa: F401  (old import path kept)
from lightning_seqmem.truncation import check_max_length, check_truncation_side, truncate_ids


def _round_up(n: int, multiple: int | None) -> int:
    if not multiple or multiple <= 1:
        return n
    return -(-n // multiple) * multiple


class PadCollator:
    """Right-pad a list of examples to the longest row (or to ``max_length``).

    Args:
        pad_token_id: id written into padding slots.
        max_length: rows longer than this are cut (``truncation_side``); ``None`` keeps every token.
        pad_to_multiple_of: round the padded length up to a multiple of this (tensor-core friendly), never past
            ``max_length``.
        pad_to_max_length: always return ``[batch, max_length]`` so the CUDA allocator reuses the same blocks.
        truncation_side: ``"right"`` keeps the start of a long row, ``"left"`` keeps its end.

    Each example is a mapping with ``input_ids: list[int]`` and optional ``labels: list[int]`` (default: a copy
    of ``input_ids``). Returns ``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding), all
    ``LongTensor[batch, seq]``.

    Example::

        >>> out = PadCollator(pad_token_id=0, pad_to_multiple_of=None)([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}])
        >>> out["labels"].tolist()
        [[5, 6, 7], [8, -100, -100]]
    """

    def __init__(
        self,
        pad_token_id: int,
        max_length: int | None = None,
        pad_to_multiple_of: int | None = 8,
        pad_to_max_length: bool = False,
        truncation_side: str = "right",
    ) -> None:
        check_max_length(max_length)
        check_truncation_side(truncation_side)
        if pad_to_max_length and max_length is None:
            raise ValueError("pad_to_max_length=True needs max_length: set max_length to the constant row length.")
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of} must be >= 1 or None.")
        self.pad_token_id = int(pad_token_id)
        self.max_length = max_length
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_to_max_length = pad_to_max_length
        self.truncation_side = truncation_side

    def padded_length(self, longest: int) -> int:
        """The ``seq`` dimension of a batch whose longest (already truncated) row has ``longest`` tokens."""
        if self.pad_to_max_length:
            return int(self.max_length)
        length = _round_up(max(longest, 1), self.pad_to_multiple_of)
        if self.max_length is not None:
            length = min(length, max(self.max_length, longest))
        return length

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [truncate_ids(ex["input_ids"], self.max_length, self.truncation_side) for ex in examples]
        labels = [
            truncate_ids(ex["labels"], self.max_length, self.truncation_side) if ex.get("labels") is not None else row
            for ex, row in zip(examples, ids)
        ]
        length = self.padded_length(max((len(r) for r in ids), default=1))
        batch = len(ids)
        input_ids = torch.full((batch, length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, length), dtype=torch.long)
        out_labels = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long)
        for i, (row, lab) in enumerate(zip(ids, labels)):
            n = len(row)
            if n:
                input_ids[i, :n] = torch.as_tensor(row, dtype=torch.long)
                out_labels[i, :n] = torch.as_tensor(lab, dtype=torch.long)
                attention_mask[i, :n] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": out_labels}


class TruncateCollator(PadCollator):
    """Cut every row to ``max_length`` and return the constant shape ``[batch, max_length]``.

    Args:
        pad_token_id: id written into padding slots.
        max_length: the constant row length.
        truncation_side: ``"right"`` keeps the start of a long row, ``"left"`` keeps its end.

    Prompt/completion rows arrive already truncated with their labels (``truncation.prompt_completion_example``).
    """

    def __init__(self, pad_token_id: int, max_length: int, truncation_side: str = "right") -> None:
        if max_length is None:
            raise ValueError("TruncateCollator needs max_length: the constant row length.")
        super().__init__(
            pad_token_id,
            max_length=max_length,
            pad_to_multiple_of=None,
            pad_to_max_length=True,
            truncation_side=truncation_side,
        )


class PackCollator:
    """Packed rows (segments back to back) to ``input_ids``, ``labels`` and ``position_ids``, no attention mask.

    Args:
        pad_token_id: id written into padding slots.
        max_length: the row length; rows are padded to it (constant shape) unless ``pad_to_longest``.
        pad_to_longest: pad to the longest row of the batch instead (rounded up to ``pad_to_multiple_of``).
        pad_to_multiple_of: used only with ``pad_to_longest``.
        return_cu_seqlens: also return ``cu_seqlens`` (1-D int32, cumulative segment lengths over the flattened
            batch, padding segments included) for custom varlen attention.

    Each example is ``{"input_ids": list[int], "seq_lengths": list[int]}`` (``PackResult.row``), with optional
    ``labels`` (e.g. -100 on prompts; default: the tokens). Every segment
    gets ``position_ids`` 0, 1, 2, ... and label -100 on its first token, so no document predicts another;
    padding is one more segment (``pad_token_id``, labels -100). Returns ``LongTensor[batch, seq]`` tensors.

    Example::

        >>> out = PackCollator(pad_token_id=0, max_length=6)([{"input_ids": [5, 6, 7, 8], "seq_lengths": [3, 1]}])
        >>> out["position_ids"].tolist(), out["labels"].tolist()
        ([[0, 1, 2, 0, 0, 1]], [[-100, 6, 7, -100, -100, -100]])
    """

    def __init__(
        self,
        pad_token_id: int,
        max_length: int,
        pad_to_longest: bool = False,
        pad_to_multiple_of: int | None = 8,
        return_cu_seqlens: bool = False,
    ) -> None:
        check_max_length(max_length)
        self.pad_token_id = int(pad_token_id)
        self.max_length = max_length
        self.pad_to_longest = pad_to_longest
        self.pad_to_multiple_of = pad_to_multiple_of
        self.return_cu_seqlens = return_cu_seqlens

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        longest = max((len(ex["input_ids"]) for ex in examples), default=1)
        if longest > self.max_length:
            raise ValueError(
                f"a packed row has {longest} tokens > max_length={self.max_length}; pack with the same max_length."
            )
        length = self.max_length
        if self.pad_to_longest:
            length = min(_round_up(longest, self.pad_to_multiple_of), self.max_length)
        batch = len(examples)
        input_ids = torch.full((batch, length), self.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.empty((batch, length), dtype=torch.long)
        cu = [0]
        for i, ex in enumerate(examples):
            seg = [int(n) for n in ex["seq_lengths"] if n > 0]
            n = sum(seg)
            if n != len(ex["input_ids"]):
                raise ValueError(f"row {i}: seq_lengths sum to {n} but the row has {len(ex['input_ids'])} tokens.")
            if n < length:
                seg.append(length - n)  # padding: its own segment, so it never touches a document
            row = torch.as_tensor(ex["input_ids"], dtype=torch.long)
            input_ids[i, :n] = row
            labels[i, :n] = torch.as_tensor(ex["labels"], dtype=torch.long) if "labels" in ex else row
            starts = torch.tensor([0] + seg[:-1]).cumsum(0)
            lens = torch.tensor(seg)
            position_ids[i] = torch.arange(length) - torch.repeat_interleave(starts, lens)
            labels[i, starts] = IGNORE_INDEX
            cu.extend((i * length + starts[1:]).tolist() + [(i + 1) * length])
        out = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
        if self.return_cu_seqlens:
            out["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
        return out
