"""The worst-case batch: one builder for the pre-allocation pass and the memory tracer.

A batch's memory depends on more than its shape: transformers skips the attention mask when every row is one
unpadded document, but builds a ``[rows, 1, length, length]`` mask (and SDPA then runs another kernel) as soon as a
row holds padding or several packed documents. So the worst case is a shape plus a *layout*: the document lengths
in each row. The DataModule knows which layouts its batches can have (``protocols.GivesWorstBatchLayout``;
``SeqMemDataModule`` asks its strategy); :func:`default_layout` reads the batch contract's keys otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_seqmem.batch import COMPLETION_MASK, CU_SEQLENS, IGNORE_INDEX, SEQUENCE_INDEX, Layout, default_layout
from lightning_seqmem.training.varlen import cu_seqlens


def check_layout(layout: Layout, rows: int, length: int) -> Layout:
    """``layout`` as a tuple of tuples, or a ``ValueError`` saying how it does not fit ``[rows, length]``."""
    layout = tuple(tuple(int(n) for n in row) for row in layout)
    if len(layout) != rows or any(sum(row) > length or any(n < 1 for n in row) for row in layout):
        raise ValueError(
            f"A worst-case layout must give {rows} rows of positive document lengths summing to at most {length} "
            f"tokens each; got {str(layout)[:120]}."
        )
    return layout


def make_dummy_batch(
    rows: int,
    length: int,
    keys: Sequence[str],
    vocab_size: int | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    layout: Layout | None = None,
    pad_token_id: int = 0,
) -> dict[str, torch.Tensor]:
    """A ``[rows, length]`` batch in the project's batch contract, laid out as ``layout`` says.

    ``input_ids`` are drawn from a private generator (the global RNG is not touched) below ``vocab_size`` (zeros
    when unknown), ``pad_token_id`` on padding; ``attention_mask`` is 1 on documents, 0 on padding; ``labels`` are
    the ids, ``-100`` on padding and, in packed batches (``position_ids`` without ``attention_mask``), on every
    document's first token; ``position_ids`` restart at 0 for every document and for the padding segment;
    ``cu_seqlens`` (1-D int32) are the segment boundaries of the flattened batch, padding segments included;
    preference pairs' ``completion_mask`` is 1 on every real token but a sequence's first and ``sequence_index``
    numbers the sequences in row order (-1 on padding: a padded pair batch needs an even number of rows, a packed
    one an even number of sequences, as the pair layouts give); any other key gets zeros.

    Args:
        rows: rows per micro-batch.
        length: tokens per row.
        keys: the keys the train loader yields.
        vocab_size: token ids are drawn from ``[0, vocab_size)``; ``None`` gives zeros.
        device: where to build the tensors.
        seed: seed of the private generator.
        layout: document lengths per row; default :func:`default_layout` of ``keys``.
        pad_token_id: the id written into padding slots.

    Example::

        batch = make_dummy_batch(4, 128, ("input_ids", "labels", "position_ids"), vocab_size=32000)
        batch["position_ids"][0, 62:66].tolist()  # [62, 63, 0, 1]: two documents per row
    """
    if rows < 1 or length < 1:
        raise ValueError(f"rows and length must be >= 1, got rows={rows}, length={length}.")
    layout = check_layout(default_layout(rows, length, keys) if layout is None else layout, rows, length)
    if vocab_size:
        ids = torch.randint(0, vocab_size, (rows, length), generator=torch.Generator().manual_seed(seed))
    else:
        ids = torch.zeros(rows, length, dtype=torch.long)
    real = torch.zeros(rows, length, dtype=torch.bool)
    first = torch.zeros(rows, length, dtype=torch.bool)  # a document's first token
    positions = torch.zeros(rows, length, dtype=torch.long)
    sequence = torch.full((rows, length), -1, dtype=torch.long)  # packed pairs: each token's sequence, -1 padding
    count = 0
    for i, row in enumerate(layout):
        start = 0
        for n in row:
            sequence[i, start : start + n] = count
            start, count = start + n, count + 1
        start = 0
        for n in (*row, length - sum(row)):  # the documents, then the padding segment (maybe empty)
            if n == 0:
                continue
            positions[i, start : start + n] = torch.arange(n)
            start += n
        ends = torch.tensor(row).cumsum(0)
        real[i, : int(ends[-1])] = True
        first[i, (ends - torch.tensor(row)).tolist()] = True
    ids = ids.masked_fill(~real, pad_token_id)
    packed = "position_ids" in keys and "attention_mask" not in keys
    ignored = ~real | first if packed else ~real
    batch: dict[str, torch.Tensor] = {}
    for key in keys:
        if key == "input_ids":
            batch[key] = ids
        elif key == "labels":
            batch[key] = ids.masked_fill(ignored, IGNORE_INDEX)
        elif key == "attention_mask":
            batch[key] = real.long()
        elif key == "position_ids":
            batch[key] = positions
        elif key == COMPLETION_MASK:  # preference pairs: every real token but a sequence's first is scored
            batch[key] = (real & ~first).long()
        elif key == SEQUENCE_INDEX:
            batch[key] = sequence
        elif key == CU_SEQLENS:
            batch[key] = cu_seqlens(positions)  # every document and padding segment restarts its positions
        else:
            batch[key] = torch.zeros(rows, length, dtype=torch.long)
    return {key: value.to(device) for key, value in batch.items()}
