"""Tests for the sequence-length warmup batch transform (pure function, plain tensors, a tiny real model)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_seqmem.batch import count_real_tokens
from lightning_seqmem.warmup import set_batch_sequence_length

VOCAB, PAD = 128, 0


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=PAD,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).float()


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama()


def padded_batch(rows: int = 50, length: int = 128, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded batch like the pad collator's; row 0 is full length, row 1 a single token."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (rows,), generator=gen)
    lengths[0], lengths[1] = length, 1
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    ids = torch.randint(1, VOCAB, (rows, length), generator=gen).masked_fill(mask == 0, PAD)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def packed_batch(doc_lengths: list[list[int]], length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Packed batch following the contract: one row per inner list, trailing padding as its own segment."""
    gen = torch.Generator().manual_seed(seed)
    ids, labels, positions = (torch.full((len(doc_lengths), length), v) for v in (PAD, -100, 0))
    for row, docs in enumerate(doc_lengths):
        col = 0
        for n in docs:
            ids[row, col : col + n] = torch.randint(1, VOCAB, (n,), generator=gen)
            labels[row, col : col + n] = ids[row, col : col + n]
            labels[row, col] = -100
            positions[row, col : col + n] = torch.arange(n)
            col += n
        positions[row, col:] = torch.arange(length - col)
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def clone(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in batch.items()}


def forward_backward(model: LlamaForCausalLM, batch: dict[str, torch.Tensor]) -> None:
    model.zero_grad()
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "labels") if k in batch}
    out = model(**inputs, use_cache=False)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def per_token_loss(model: LlamaForCausalLM, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[batch, seq]`` loss of predicting ``labels[:, t]`` (0 where not trained), with the model's own shift."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits.float()
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1), reduction="none", ignore_index=-100
    )
    return torch.nn.functional.pad(loss.view(logits.shape[0], -1), (1, 0))


# ------------------------------------------------------------------------------------ Composer equivalence


@pytest.mark.parametrize("curr", [8, 64])
def test_truncate_matches_composer(model, curr):
    before = padded_batch()
    batch = clone(before)
    out = set_batch_sequence_length(batch, curr)
    assert out is batch
    assert set(batch) == set(before)
    for key in before:
        assert batch[key].shape == (50, min(128, curr))
        assert torch.equal(batch[key], before[key][:, :curr])
    forward_backward(model, batch)


@pytest.mark.parametrize("curr", [8, 64])
def test_truncate_preserve_end_of_sequence(model, curr):
    before = padded_batch()
    batch = clone(before)
    set_batch_sequence_length(batch, curr, preserve_end_of_sequence=True)
    assert set(batch) == set(before)
    lengths = before["attention_mask"].sum(dim=1)
    for row, n in enumerate(lengths.tolist()):
        kept = min(curr, n)
        assert batch["input_ids"][row, kept - 1] == before["input_ids"][row, n - 1]
        assert batch["labels"][row, kept - 1] == before["labels"][row, n - 1]
        assert torch.equal(batch["input_ids"][row, : kept - 1], before["input_ids"][row, : kept - 1])
        assert batch["attention_mask"][row].sum() == kept
    forward_backward(model, batch)


@pytest.mark.parametrize("curr", [8, 64])
def test_reshape_matches_composer(model, curr):
    before = padded_batch()
    batch = clone(before)
    set_batch_sequence_length(batch, curr, truncate=False)
    assert set(batch) == set(before)
    shapes = {tuple(v.shape) for v in batch.values()}
    assert len(shapes) == 1 and batch["input_ids"].shape[1] == curr
    # Order kept: the new rows are the old tokens in order, minus at most curr - 1 at the end, minus rows that
    # were only padding.
    flat_ids, flat_mask = before["input_ids"].reshape(-1), before["attention_mask"].reshape(-1)
    keep = flat_ids.numel() // curr * curr
    old_rows = flat_ids[:keep].view(-1, curr)
    nonempty = flat_mask[:keep].view(-1, curr).any(dim=1)
    assert torch.equal(batch["input_ids"], old_rows[nonempty])
    assert torch.equal(batch["attention_mask"], flat_mask[:keep].view(-1, curr)[nonempty])
    assert flat_mask.sum() - batch["attention_mask"].sum() <= curr - 1
    # Labels too, except that every new row and every old document starts with -100 (no cross-row prediction).
    old_labels = before["labels"].reshape(-1)[:keep].view(-1, curr)[nonempty]
    changed = batch["labels"] != old_labels
    assert (batch["labels"][changed] == -100).all()
    assert (batch["labels"][:, 0] == -100).all()
    forward_backward(model, batch)


def test_noop_when_short():
    before = padded_batch(4, 16)
    batch = clone(before)
    for truncate in (True, False):
        set_batch_sequence_length(batch, 16, truncate=truncate)
        set_batch_sequence_length(batch, 300, truncate=truncate)
        assert all(torch.equal(batch[k], before[k]) for k in before)


def test_reshape_drops_rows_of_padding():
    batch = padded_batch(4, 32)
    batch["attention_mask"][:2] = 1
    batch["attention_mask"][2:] = 0
    batch["attention_mask"][2, 0] = 1  # row 2 holds one real token
    set_batch_sequence_length(batch, 8, truncate=False)
    # rows 0-1 give 8 rows, row 2 gives 1 (its first quarter), row 3 none
    assert batch["input_ids"].shape == (9, 8)
    assert batch["attention_mask"].any(dim=1).all()


def test_all_padding_batch_keeps_one_row():
    batch = padded_batch(2, 16)
    batch["attention_mask"].zero_()
    set_batch_sequence_length(batch, 4, truncate=False)
    assert batch["input_ids"].shape == (1, 4)


def test_left_padding_reshape_starts_documents_with_ignore_index():
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = (ids != 0).long()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    set_batch_sequence_length(batch, 4, truncate=False)
    assert batch["input_ids"].tolist() == [[0, 0, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14]]
    assert batch["labels"].tolist() == [[-100, -100, -100, 6], [-100, 8, -100, 10], [-100, 12, 13, 14]]


# ----------------------------------------------------------------------------------------- packed batches


def segments(batch: dict[str, torch.Tensor]) -> list[tuple[int, int, int]]:
    """(row, start, end) of every segment, found the way transformers finds them: position diff != 1."""
    out = []
    for row, pos in enumerate(batch["position_ids"].tolist()):
        start = 0
        for col in range(1, len(pos) + 1):
            if col == len(pos) or pos[col] - pos[col - 1] != 1:
                out.append((row, start, col))
                start = col
    return out


def test_reshape_packed_keeps_documents_apart(model):
    """Per-document losses after reshape equal separate runs of each resulting piece (<= 1e-5, fp32)."""
    before = packed_batch([[20, 9, 3], [30], [5, 17, 8]], length=32)
    batch = clone(before)
    set_batch_sequence_length(batch, 12, truncate=False, pad_token_id=PAD)
    assert set(batch) == set(before) and batch["input_ids"].shape[1] == 12
    # same tokens in the same order (the packed batch has 96 tokens = 8 rows of 12; padding-only rows dropped)
    real = (batch["input_ids"] != PAD) | (batch["labels"] != -100)
    assert batch["input_ids"][real].tolist() == before["input_ids"][before["input_ids"] != PAD].tolist()
    losses = per_token_loss(model, batch)
    trained = 0
    for row, start, end in segments(batch):
        piece = {k: batch[k][row : row + 1, start:end] for k in ("input_ids", "labels", "position_ids")}
        assert piece["position_ids"][0, 0] == 0, "every segment restarts at position 0"
        assert piece["labels"][0, 0] == -100, "no segment predicts its first token from another"
        alone = per_token_loss(model, {"input_ids": piece["input_ids"], "labels": piece["labels"]})
        torch.testing.assert_close(losses[row, start:end], alone[0], atol=1e-5, rtol=0)
        trained += int((piece["labels"] != -100).sum())
    assert trained == int((batch["labels"] != -100).sum()) > 0
    forward_backward(model, batch)


def test_reshape_packed_wrapped_row_after_padding(model):
    """Row 1 continues a document (positions 4, 5, ...) and row 0 ends in padding (positions 0-3): a plain reshape
    to 12 puts both in one new row as one segment (positions 0-3 then 4-11); ours starts a new segment."""
    before = packed_batch([[12], [10]], length=16)
    before["position_ids"][1, :10] += 4  # a document wrapped from an earlier row
    before["labels"][1, 0] = before["input_ids"][1, 0]
    batch = clone(before)
    set_batch_sequence_length(batch, 12, truncate=False, pad_token_id=PAD)
    assert batch["input_ids"].shape == (2, 12)  # 32 tokens: 2 rows of 12, 8 padding tokens dropped
    assert batch["position_ids"][1].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]
    assert batch["labels"][1, 4] == -100
    doc = {k: batch[k][1:, 4:] for k in ("input_ids", "labels")}
    torch.testing.assert_close(per_token_loss(model, batch)[1, 4:], per_token_loss(model, doc)[0], atol=1e-5, rtol=0)
    # the plain reshape really does mix them, so the test above is not vacuous
    plain = {k: v.reshape(-1)[:24].view(2, 12) for k, v in before.items()}
    assert not torch.allclose(per_token_loss(model, plain)[1, 5:], per_token_loss(model, doc)[0, 1:], atol=1e-5)


def test_reshape_packed_uncut_document_loss_equals_original(model):
    before = packed_batch([[6, 10], [16]], length=16)
    alone = per_token_loss(model, {k: before[k][:, :6] for k in ("input_ids", "labels")})[0]
    batch = clone(before)
    set_batch_sequence_length(batch, 8, truncate=False, pad_token_id=PAD)
    # the 6-token document sits alone at the start of row 0 and is not cut
    torch.testing.assert_close(per_token_loss(model, batch)[0, :6], alone, atol=1e-5, rtol=0)


def test_truncate_packed_recomputes_cu_seqlens(model):
    batch = packed_batch([[5, 7, 2], [9, 3]], length=16)
    batch["cu_seqlens"] = torch.tensor([0, 5, 12, 14, 16, 25, 28, 32], dtype=torch.int32)
    set_batch_sequence_length(batch, 8)
    assert batch["input_ids"].shape == (2, 8)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7]]
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["cu_seqlens"].tolist() == [0, 5, 8, 16]
    forward_backward(model, batch)


def test_reshape_drops_cu_seqlens_without_positions():
    batch = padded_batch(2, 16)
    batch["cu_seqlens"] = torch.tensor([0, 16, 32], dtype=torch.int32)
    set_batch_sequence_length(batch, 8, truncate=False)
    assert "cu_seqlens" not in batch


@settings(max_examples=60, deadline=None)
@given(
    docs=st.lists(st.lists(st.integers(1, 12), min_size=1, max_size=4), min_size=1, max_size=4),
    curr=st.integers(1, 20),
    wrapped=st.booleans(),
)
def test_reshape_packed_invariants(docs, curr, wrapped):
    length = 24

    def fit(row: list[int]) -> list[int]:
        kept = []
        for n in row:
            if sum(kept) + n <= length:
                kept.append(n)
        return kept

    before = packed_batch([fit(row) for row in docs], length)
    if wrapped:  # a row that continues a document from the previous row (wrapped packing)
        before["position_ids"][0, : docs[0][0]] += 7  # first document of row 0
        before["labels"][0, 0] = before["input_ids"][0, 0]
    batch = clone(before)
    set_batch_sequence_length(batch, curr, truncate=False, pad_token_id=PAD)
    if length <= curr:
        assert all(torch.equal(batch[k], before[k]) for k in before)
        return
    real_before = before["input_ids"][before["input_ids"] != PAD]
    real_after = batch["input_ids"][batch["input_ids"] != PAD]
    assert len(real_before) - len(real_after) <= curr - 1
    assert torch.equal(real_after, real_before[: len(real_after)])
    for row, start, _ in segments(batch):
        assert batch["position_ids"][row, start] == 0
        assert batch["labels"][row, start] == -100
    assert count_real_tokens(batch, PAD) == int(((batch["input_ids"] != PAD) | (batch["labels"] != -100)).sum())


# --------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("batch", "kwargs", "error", "match"),
    [
        ([torch.zeros(2, 4)], {}, TypeError, "collate_fn"),
        ({"input_ids": torch.zeros(4, dtype=torch.long)}, {}, ValueError, "unsqueeze"),
        ({"input_ids": torch.zeros(2, 8), "labels": torch.zeros(2, 6)}, {"truncate": False}, ValueError, "same shape"),
        (
            {"input_ids": torch.zeros(2, 8), "position_ids": torch.zeros(2, 8)},
            {"preserve_end_of_sequence": True},
            ValueError,
            "attention_mask",
        ),
        (
            {"input_ids": torch.zeros(2, 8), "attention_mask": torch.ones(2, 8)},
            {"preserve_end_of_sequence": True, "truncate": False},
            ValueError,
            "truncate=True",
        ),
        ({"input_ids": torch.zeros(2, 8)}, {"curr_seq_len": 0}, ValueError, ">= 1"),
        ({"meta": "x"}, {}, ValueError, "input_ids"),
    ],
)
def test_bad_input(batch, kwargs, error, match):
    kwargs.setdefault("curr_seq_len", 4)
    with pytest.raises(error, match=match):
        set_batch_sequence_length(batch, **kwargs)
