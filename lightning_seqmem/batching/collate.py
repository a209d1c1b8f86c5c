"""Collators: lists of tokenized examples to the batch dicts of the batch contract (see ARCHITECTURE.md).

Every collator returns ``dict[str, torch.Tensor]`` with 2-D ``[batch, seq]`` long tensors. Collators hold no
counters: they run in dataloader workers, so truncation is counted at dataset level (``truncation.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lightning_seqmem.batch import IGNORE_INDEX, real_token_mask  # noqa: F401  (old import path kept)
from lightning_seqmem.batching.truncation import check_max_length, check_truncation_side, cut_tokens
from lightning_seqmem.data.tokens import as_token_source


def as_examples(examples: Any) -> Sequence[Mapping[str, Any]]:
    """A batch in any accepted form to a list of examples (mappings of token arrays or lists).

    Besides a list of mappings, a collator takes a ``datasets.Dataset`` (its ``input_ids`` and, if present,
    ``labels``), a ``pyarrow`` ``ListArray``/``ChunkedArray`` or a ``(flat, offsets)`` pair of numpy arrays:
    rows are numpy views of the Arrow buffers, never Python lists.
    """
    if isinstance(examples, (list, tuple)) and (not examples or isinstance(examples[0], Mapping)):
        return examples
    ids = as_token_source(examples)
    has_labels = hasattr(examples, "column_names") and "labels" in examples.column_names
    labels = as_token_source(examples, column="labels") if has_labels else None
    return [
        {"input_ids": ids.row(i), **({"labels": labels.row(i)} if labels is not None else {})} for i in range(len(ids))
    ]


def _cut(row: Any, max_length: int | None, side: str) -> np.ndarray:
    """``row`` as an array of at most ``max_length`` tokens (``truncation.cut_tokens`` on a view)."""
    return cut_tokens(np.asarray(row, dtype=np.int64), max_length, side)


def _fill(rows: Sequence[np.ndarray], lengths: np.ndarray, out: np.ndarray) -> None:
    """Write ``rows`` left-aligned into ``out`` ``[batch, seq]`` (one bulk copy; row-major mask order)."""
    if len(rows) and lengths.sum():
        out[np.arange(out.shape[1]) < lengths[:, None]] = np.concatenate(rows)


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

    def __call__(self, examples: Sequence[Mapping[str, Any]] | Any) -> dict[str, torch.Tensor]:
        examples = as_examples(examples)
        ids = [_cut(ex["input_ids"], self.max_length, self.truncation_side) for ex in examples]
        labels = [
            _cut(ex["labels"], self.max_length, self.truncation_side) if ex.get("labels") is not None else row
            for ex, row in zip(examples, ids)
        ]
        lengths = np.fromiter((len(r) for r in ids), dtype=np.int64, count=len(ids))
        length = self.padded_length(int(lengths.max(initial=1)))
        batch = len(ids)
        input_ids = np.full((batch, length), self.pad_token_id, dtype=np.int64)
        out_labels = np.full((batch, length), IGNORE_INDEX, dtype=np.int64)
        _fill(ids, lengths, input_ids)
        _fill(labels, lengths, out_labels)
        attention_mask = (np.arange(length) < lengths[:, None]).astype(np.int64)
        return {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention_mask),
            "labels": torch.from_numpy(out_labels),
        }


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

    Each example is ``{"input_ids": list[int], "seq_lengths": list[int]}`` (``PackResult.row``; without
    ``seq_lengths`` the row is one document), with optional ``labels`` (e.g. -100 on prompts; default: the
    tokens); arrays work as well as lists, and so does a batch given as Arrow (see ``as_examples``). Every segment
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

    def __call__(self, examples: Sequence[Mapping[str, Any]] | Any) -> dict[str, torch.Tensor]:
        examples = as_examples(examples)
        ids = [np.asarray(ex["input_ids"], dtype=np.int64) for ex in examples]
        lengths = np.fromiter((len(r) for r in ids), dtype=np.int64, count=len(ids))
        longest = int(lengths.max(initial=1))
        if longest > self.max_length:
            raise ValueError(
                f"a packed row has {longest} tokens > max_length={self.max_length}; pack with the same max_length."
            )
        length = self.max_length
        if self.pad_to_longest:
            length = min(_round_up(longest, self.pad_to_multiple_of), self.max_length)
        batch = len(examples)
        segments = []  # every segment of the flattened batch, padding included, row by row
        for i, ex in enumerate(examples):
            seg = np.asarray(ex["seq_lengths"] if "seq_lengths" in ex else [lengths[i]], dtype=np.int64)
            seg = seg[seg > 0]
            if int(seg.sum()) != lengths[i]:
                raise ValueError(f"row {i}: seq_lengths sum to {int(seg.sum())} but the row has {lengths[i]} tokens.")
            segments.append(seg)
            if lengths[i] < length:
                segments.append(np.asarray([length - lengths[i]]))  # padding: its own segment, never a document
        input_ids = np.full((batch, length), self.pad_token_id, dtype=np.int64)
        _fill(ids, lengths, input_ids)
        labels = input_ids.copy()
        with_labels = [
            np.asarray(ex["labels"], dtype=np.int64) if "labels" in ex else row for ex, row in zip(examples, ids)
        ]
        _fill(with_labels, lengths, labels)
        labels[np.arange(length) >= lengths[:, None]] = IGNORE_INDEX
        seg_lengths = np.concatenate(segments) if segments else np.zeros(0, np.int64)
        seg_starts = np.cumsum(seg_lengths) - seg_lengths  # over the flattened [batch * seq]
        position_ids = np.arange(batch * length) - np.repeat(seg_starts, seg_lengths)
        labels.reshape(-1)[seg_starts] = IGNORE_INDEX  # no document predicts another
        out = {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(position_ids.reshape(batch, length)),
        }
        if self.return_cu_seqlens:
            cu = np.concatenate([[0], np.cumsum(seg_lengths)])
            out["cu_seqlens"] = torch.from_numpy(cu.astype(np.int32))
        return out
