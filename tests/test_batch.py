"""The batch contract (lightning_seqmem.batch): one real-token counter, one label-token counter, for every layout."""

import torch
import torch.nn.functional as F

from lightning_seqmem.batch import (
    IGNORE_INDEX,
    PACK_KEYS,
    PAD_KEYS,
    count_label_tokens,
    count_real_tokens,
    real_token_mask,
)
from lightning_seqmem.batching.collate import PackCollator, PadCollator, TruncateCollator
from lightning_seqmem.training.metrics import TokenEfficiency

PAD = 0
DOCS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 0]]  # the last document ends in a token equal to the pad id (EOS as pad)


def _pad_batch():
    """[2, 5]: a row of 3 real tokens and a row of 2, right-padded."""
    ids = torch.tensor([[5, 6, 7, PAD, PAD], [8, 9, PAD, PAD, PAD]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}


def _pack_batch():
    """[1, 12]: documents of 5 and 4 tokens (the first ends in the pad id), then 3 slots of padding."""
    ids = torch.tensor([[10, 11, 12, 13, PAD, 5, 6, 7, 8, PAD, PAD, PAD]])
    labels = ids.clone()
    labels[0, [0, 5, 9, 10, 11]] = IGNORE_INDEX  # each document's first token and the padding
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]])
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def test_pad_layout_counts_the_attention_mask():
    batch = _pad_batch()
    assert set(batch) == set(PAD_KEYS)
    assert torch.equal(real_token_mask(batch, PAD), batch["attention_mask"].bool())
    assert int(count_real_tokens(batch, PAD)) == 5
    assert int(count_label_tokens(batch)) == 3  # 6, 7 of row 0 and 9 of row 1 are predicted


def test_pack_layout_keeps_a_real_token_equal_to_the_pad_id():
    batch = _pack_batch()
    assert set(batch) == set(PACK_KEYS)
    mask = real_token_mask(batch, PAD)
    assert mask.tolist() == [[True] * 9 + [False] * 3]  # slot 4 holds the pad id but is trained on
    assert int(count_real_tokens(batch, PAD)) == 9
    assert int(count_label_tokens(batch)) == 7  # 9 real tokens minus the 2 document starts


def test_without_a_pad_id_the_loss_decides_and_without_labels_every_slot_counts():
    batch = _pack_batch()
    assert torch.equal(real_token_mask(batch), batch["labels"] != IGNORE_INDEX)
    assert int(count_real_tokens({"input_ids": batch["input_ids"]}, PAD)) == batch["input_ids"].numel()
    positions_only = {"position_ids": batch["position_ids"], "cu_seqlens": torch.tensor([0, 5, 9, 12])}
    assert int(count_real_tokens(positions_only)) == 12  # shape from the first [batch, seq] tensor


def test_counts_stay_on_the_device_as_long_tensors():
    for batch in (_pad_batch(), _pack_batch()):
        for count in (count_real_tokens(batch, PAD), count_label_tokens(batch)):
            assert count.ndim == 0 and count.dtype == torch.long


def test_collated_batches_count_every_document_token():
    total = sum(len(d) for d in DOCS)
    examples = [{"input_ids": d} for d in DOCS]
    assert int(count_real_tokens(PadCollator(PAD)(examples), PAD)) == total
    assert int(count_real_tokens(TruncateCollator(PAD, max_length=8)(examples), PAD)) == total
    flat = [t for d in DOCS for t in d]
    packed = PackCollator(PAD, max_length=16)([{"input_ids": flat, "seq_lengths": [len(d) for d in DOCS]}])
    assert int(count_real_tokens(packed, PAD)) == total
    assert int(count_label_tokens(packed)) == total - len(DOCS)  # no document predicts its first token


def test_label_tokens_are_the_terms_of_the_model_loss():
    batch = _pack_batch()
    logits = torch.randn(*batch["input_ids"].shape, 16, generator=torch.Generator().manual_seed(0))
    shifted = logits[:, :-1].reshape(-1, 16), batch["labels"][:, 1:].reshape(-1)
    total = F.cross_entropy(*shifted, ignore_index=IGNORE_INDEX, reduction="sum")
    mean = F.cross_entropy(*shifted, ignore_index=IGNORE_INDEX)
    assert torch.isclose(total / mean, count_label_tokens(batch).float())


def test_token_efficiency_uses_the_same_counter():
    metric = TokenEfficiency(pad_token_id=PAD)
    for batch in (_pad_batch(), _pack_batch()):
        metric.update(batch)
    assert int(metric.real_tokens) == int(count_real_tokens(_pad_batch(), PAD) + count_real_tokens(_pack_batch(), PAD))
    assert torch.isclose(metric.compute(), torch.tensor((5 + 9) / (10 + 12)))
