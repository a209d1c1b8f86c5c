"""TokenEfficiency: sums real tokens and slots (not per-batch ratios), for padded and packed batches."""

import torch

from lightning_seqmem.batching.collate import PackCollator, PadCollator
from lightning_seqmem.training.metrics import TokenEfficiency


def test_efficiency_is_a_ratio_of_sums_over_batches():
    m = TokenEfficiency(pad_token_id=0)
    m.update(PadCollator(0, pad_to_multiple_of=None)([{"input_ids": [1, 2, 3, 4]}, {"input_ids": [5]}]))  # 5 / 8
    m.update(PadCollator(0, pad_to_multiple_of=None)([{"input_ids": [6, 7]}]))  # 2 / 2
    assert torch.isclose(m.compute(), torch.tensor(7 / 10))  # not the mean of 5/8 and 1


def test_packed_batches_count_pad_id_tokens_inside_documents_as_real():
    batch = PackCollator(0, max_length=6)([{"input_ids": [3, 0, 4], "seq_lengths": [3]}])
    m = TokenEfficiency(pad_token_id=0)
    m.update(batch)
    assert m.compute().item() == 0.5
