"""Padding-free preference pairs: both sequences of a pair back to back in one row, rows packed best fit.

The pair is the packing item (its length: chosen sequence + rejected sequence), so a pair never straddles two rows,
and therefore never two micro-batches or two ranks, whatever sampler serves the rows. DPO compares the two
log-probabilities of a pair in one loss term; keeping them in one row makes that hold by construction, with no
pair-aware sampler to get right. The price is a coarser item (up to twice a sequence), which best fit on the
dataset's whole length distribution absorbs. A ``row_length`` of ``2 * max_length`` holds any pair, and ``B`` such
rows have the slots of TRL's ``[2B, max_length]`` padded batch.

Rows follow the pack layout of the batch contract (``collate.PackCollator`` builds them: ``position_ids`` restart at
0 for every sequence, padding is a segment of its own, no ``attention_mask``), plus ``completion_mask`` and
``sequence_index`` (the sequence of each token, -1 on padding). Sequences are numbered as the rows of TRL's padded
batch: the chosen sequence of the batch's pair ``k`` is ``k``, its rejected one ``P + k``, so per-sequence sums
``chunk(2)`` into chosen and rejected exactly as padded rows do. Call the model with ``use_cache=False``, as for any
packed batch: with a cache, transformers' SDPA path does not look for packed sequences in ``position_ids`` and
lets them attend to each other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lightning_seqmem.batch import COMPLETION_MASK, IGNORE_INDEX, SEQUENCE_INDEX
from lightning_seqmem.batching.bin_packing import pack_bins
from lightning_seqmem.batching.collate import PackCollator, _fill
from lightning_seqmem.batching.pair_collate import pair_sequences, ref_logps
from lightning_seqmem.batching.preference import PreferenceLimits, name_rows
from lightning_seqmem.batching.truncation import check_max_length


def plan_pair_rows(pair_lengths: np.ndarray, row_length: int, first_row: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Pack whole pairs into rows of ``row_length`` tokens (``bin_packing.pack_bins``: best fit, then the exact
    repack of rows with gaps).

    Args:
        pair_lengths: ``[pairs]`` tokens of both sequences after truncation (``PairSpans.pair_lengths``).
        row_length: row capacity.
        first_row: dataset index of the first pair, for error messages.

    Returns:
        ``(pairs, offsets)``: row ``r`` holds pairs ``pairs[offsets[r] : offsets[r + 1]]`` (longest first).

    Raises:
        ValueError: a pair longer than ``row_length`` or an empty one (a pair that lost its completions), naming it.

    Example::

        >>> pairs, offsets = plan_pair_rows(np.array([6, 3, 4, 2]), 8)
        >>> [pairs[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
        [[0, 3], [2, 1]]
    """
    check_max_length(row_length, "row_length")
    lengths = np.asarray(pair_lengths, dtype=np.int64)
    if (lengths > row_length).any():
        raise ValueError(
            f"{name_rows(lengths > row_length, first_row)}: the pair (chosen + rejected) is longer than "
            f"row_length={row_length}; use row_length >= 2 * max_length so every pair fits."
        )
    if (lengths < 1).any():
        raise ValueError(f"{name_rows(lengths < 1, first_row)}: empty pair; drop pairs that lost a completion first.")
    order, bin_of = pack_bins(lengths, row_length)
    by_row = np.argsort(bin_of, kind="stable")
    counts = np.bincount(bin_of, minlength=int(bin_of.max(initial=-1)) + 1)
    return order[by_row], np.concatenate([[0], np.cumsum(counts)])


class PackedPairCollator:
    """Rows of pairs to one packed batch: ``input_ids``, ``labels``, ``position_ids``, ``completion_mask``,
    ``sequence_index``, all ``LongTensor[rows, seq]``.

    Args:
        pad_token_id: id written into padding slots.
        limits: truncation, the same as the padded collator's (each sequence cut as TRL cuts it).
        row_length: the row capacity (:func:`plan_pair_rows`' ``row_length``); rows are padded to it unless
            ``pad_to_longest``.
        pad_to_longest: pad to the batch's longest row instead, rounded up to ``pad_to_multiple_of``.
        pad_to_multiple_of: used only with ``pad_to_longest``.
        return_cu_seqlens: also return ``cu_seqlens`` (as ``PackCollator``).

    Each element of the batch is a row: a sequence of pair examples (``{"prompt_ids", "chosen_ids",
    "rejected_ids"}``, optionally the reference log-probabilities, returned as ``[pairs]`` tensors in the batch's
    pair order). ``completion_mask`` is 1 on the completion tokens a sequence predicts: never its first token,
    which the token before it (another sequence) must not predict. ``labels`` are the same tokens, -100 elsewhere.

    Example::

        >>> out = PackedPairCollator(0, PreferenceLimits(None), row_length=8)(
        ...     [[{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5]}]])
        >>> out["position_ids"].tolist(), out["sequence_index"].tolist()
        ([[0, 1, 2, 0, 1, 2, 3, 0]], [[0, 0, 0, 1, 1, 1, 1, -1]])
    """

    def __init__(
        self,
        pad_token_id: int,
        limits: PreferenceLimits,
        row_length: int,
        pad_to_longest: bool = False,
        pad_to_multiple_of: int | None = 8,
        return_cu_seqlens: bool = False,
    ) -> None:
        # The pack layout (positions, first labels, padding segment) has one owner: PackCollator.
        self._pack = PackCollator(
            pad_token_id,
            row_length,
            pad_to_longest=pad_to_longest,
            pad_to_multiple_of=pad_to_multiple_of,
            return_cu_seqlens=return_cu_seqlens,
        )
        self.limits = limits

    def __call__(self, rows: Sequence[Sequence[Mapping[str, Any]]]) -> dict[str, torch.Tensor]:
        pairs = [example for row in rows for example in row]
        sequences, prompt_kept = pair_sequences(pairs, self.limits)
        labels = [np.where(np.arange(len(s)) >= p, s, IGNORE_INDEX) for s, p in zip(sequences, prompt_kept)]
        lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
        first = np.cumsum([0] + [len(row) for row in rows])
        # Row r holds, for each of its pairs k: chosen sequence k, then rejected sequence P + k.
        order = [
            np.stack([np.arange(a, b), np.arange(a, b) + len(pairs)], axis=1).reshape(-1)
            for a, b in zip(first[:-1], first[1:])
        ]
        out = self._pack(
            [
                {
                    "input_ids": np.concatenate([sequences[i] for i in ids]) if len(ids) else [],
                    "labels": np.concatenate([labels[i] for i in ids]) if len(ids) else [],
                    "seq_lengths": lengths[ids],
                }
                for ids in order
            ]
        )
        sequence_index = np.full(out["input_ids"].shape, -1, dtype=np.int64)
        _fill(
            [np.repeat(ids, lengths[ids]) for ids in order],
            np.array([lengths[ids].sum() for ids in order]),
            sequence_index,
        )
        out[COMPLETION_MASK] = (out["labels"] != IGNORE_INDEX).long()
        out[SEQUENCE_INDEX] = torch.from_numpy(sequence_index)
        return {**out, **ref_logps(pairs)}
