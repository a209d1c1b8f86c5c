"""Collators: the batch contract of ARCHITECTURE.md for pad, truncate and pack, and token conservation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_seqmem.batching import pack_sequences
from lightning_seqmem.batching.collate import PackCollator, PadCollator, TruncateCollator, real_token_mask

PAD = 0
rows_strategy = st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=30), min_size=1, max_size=6)


def test_pad_collator_shapes_labels_and_rounding():
    out = PadCollator(PAD)([{"input_ids": [5, 6, 7]}, {"input_ids": [8], "labels": [-100]}])
    assert set(out) == {"input_ids", "attention_mask", "labels"}
    assert out["input_ids"].shape == (2, 8) and out["input_ids"].dtype == torch.long
    assert out["labels"][0, :3].tolist() == [5, 6, 7] and out["labels"][1].tolist() == [-100] * 8
    assert out["attention_mask"].sum(1).tolist() == [3, 1]


def test_pad_collator_truncates_and_caps_at_max_length():
    out = PadCollator(PAD, max_length=10)([{"input_ids": list(range(1, 15))}])
    assert out["input_ids"].shape == (1, 10) and out["input_ids"][0].tolist() == list(range(1, 11))
    left = PadCollator(PAD, max_length=4, truncation_side="left")([{"input_ids": [1, 2, 3, 4, 5, 6]}])
    assert left["input_ids"][0].tolist() == [3, 4, 5, 6]
    fixed = PadCollator(PAD, max_length=16, pad_to_max_length=True)([{"input_ids": [1]}])
    assert fixed["input_ids"].shape == (1, 16)


def test_truncate_collator_is_constant_shape():
    coll = TruncateCollator(PAD, max_length=6)
    for rows in ([[1]], [[1, 2, 3, 4, 5, 6, 7, 8], [9]]):
        assert coll([{"input_ids": r} for r in rows])["input_ids"].shape == (len(rows), 6)


def test_pack_collator_contract():
    out = PackCollator(PAD, max_length=8, return_cu_seqlens=True)(
        [
            {"input_ids": [5, 6, 7, 8], "seq_lengths": [3, 1]},
            {"input_ids": [1, 0, 2, 3, 4, 5, 6, 7], "seq_lengths": [8]},
        ]
    )
    assert set(out) == {"input_ids", "labels", "position_ids", "cu_seqlens"}  # no attention_mask
    assert out["position_ids"][0].tolist() == [0, 1, 2, 0, 0, 1, 2, 3]  # padding is its own segment
    assert out["labels"][0].tolist() == [-100, 6, 7, -100, -100, -100, -100, -100]
    assert out["labels"][1].tolist() == [-100, 0, 2, 3, 4, 5, 6, 7]
    assert out["cu_seqlens"].tolist() == [0, 3, 4, 8, 16] and out["cu_seqlens"].dtype == torch.int32
    # A real token equal to the pad id (row 1, slot 1) still counts as real: its label is not -100.
    assert real_token_mask(out, PAD).sum(1).tolist() == [4, 8]


def test_pack_collator_rejects_bad_rows():
    with pytest.raises(ValueError, match="seq_lengths sum to 2 but the row has 3 tokens"):
        PackCollator(PAD, 4)([{"input_ids": [1, 2, 3], "seq_lengths": [2]}])
    with pytest.raises(ValueError, match="5 tokens > max_length=4"):
        PackCollator(PAD, 4)([{"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [5]}])


@settings(max_examples=50, deadline=None)
@given(
    rows=rows_strategy, max_length=st.integers(2, 40), side=st.sampled_from(["right", "left"]), truncate=st.booleans()
)
def test_pad_and_truncate_collators_conserve_tokens(rows, max_length, side, truncate):
    coll = (
        TruncateCollator(PAD, max_length, truncation_side=side)
        if truncate
        else PadCollator(PAD, max_length=max_length, truncation_side=side)
    )
    out = coll([{"input_ids": r} for r in rows])
    mask = real_token_mask(out, PAD)
    for i, r in enumerate(rows):
        kept = r[:max_length] if side == "right" else r[max(0, len(r) - max_length) :]
        assert out["input_ids"][i][mask[i]].tolist() == kept
    assert int(mask.sum()) + sum(max(0, len(r) - max_length) for r in rows) == sum(len(r) for r in rows)


@settings(max_examples=50, deadline=None)
@given(docs=rows_strategy, max_length=st.integers(2, 40))
def test_pack_collator_conserves_tokens_and_separates_documents(docs, max_length):
    docs = [[t + 1 for t in d] for d in docs]  # keep the pad id out of the documents
    packed = pack_sequences(docs, max_length)
    out = PackCollator(PAD, max_length)([packed.row(r) for r in range(packed.num_rows)])
    mask = real_token_mask(out, PAD)
    assert int(mask.sum()) == sum(len(d) for d in docs)
    pieces = []
    for i in range(packed.num_rows):
        pos = out["position_ids"][i]
        starts = (pos == 0).nonzero().flatten().tolist() + [max_length]
        for a, b in zip(starts[:-1], starts[1:]):
            assert out["labels"][i, a] == -100  # no segment predicts its first token from another
            if mask[i, a]:
                pieces.append(out["input_ids"][i, a:b].tolist())
    expected = [d[j : j + max_length] for d in docs for j in range(0, len(d), max_length)]
    assert sorted(pieces) == sorted(expected)
