"""The worst-case batch: layouts (who asks whom) and the one builder the pre-allocator and the tracer share."""

import numpy as np
import pytest
import torch

from lightning_seqmem.batch import IGNORE_INDEX, default_layout, full_rows
from lightning_seqmem.batching.collate import PackCollator
from lightning_seqmem.batching.settings import BatchingSettings
from lightning_seqmem.batching.strategies import make_strategy
from lightning_seqmem.memory.worst_batch import make_dummy_batch
from lightning_seqmem.protocols import GivesWorstBatchLayout

PACK = ("input_ids", "labels", "position_ids")
PAD = ("input_ids", "attention_mask", "labels")


def test_packed_rows_match_what_the_pack_collator_makes():
    """Same layout through our builder and through the real collator: same mask-relevant tensors."""
    layout = ((3, 4), (8,))
    ours = make_dummy_batch(2, 8, (*PACK, "cu_seqlens"), vocab_size=50, layout=layout, pad_token_id=0)
    ids = ours["input_ids"]
    real = PackCollator(pad_token_id=0, max_length=8, return_cu_seqlens=True)(
        [{"input_ids": ids[0, :7].tolist(), "seq_lengths": [3, 4]}, {"input_ids": ids[1].tolist()}]
    )
    for key in (*PACK, "cu_seqlens"):
        assert torch.equal(ours[key], real[key].to(ours[key].dtype)), key


def test_padded_rows_and_defaults_by_keys():
    batch = make_dummy_batch(3, 6, PAD, vocab_size=50, pad_token_id=7)
    assert batch["attention_mask"].tolist() == [[1] * 6, [1] * 6, [1] * 5 + [0]]  # padding inside a row
    assert batch["input_ids"][2, 5] == 7 and batch["labels"][2, 5] == IGNORE_INDEX
    assert torch.equal(batch["labels"][:2], batch["input_ids"][:2])
    assert default_layout(2, 8, PACK) == ((4, 4), (4, 4))  # several documents per row
    assert default_layout(2, 8, ("input_ids", "labels")) == full_rows(2, 8)
    state = torch.get_rng_state()
    assert make_dummy_batch(1, 3, ("input_ids",))["input_ids"].sum() == 0  # unknown vocab: zeros
    assert torch.equal(state, torch.get_rng_state())  # private generator
    with pytest.raises(ValueError, match="2 rows of positive document lengths summing to at most 8"):
        make_dummy_batch(2, 8, PACK, layout=((5, 4), (8,)))


def test_strategies_say_when_rows_are_never_padded():
    pad, truncate, pack = (
        make_strategy(BatchingSettings(max_length=16, batching=name)) for name in ("pad", "truncate", "pack")
    )
    assert pad.worst_layout(2, 16, np.array([3, 16])) == ((16,), (15,))
    assert pad.worst_layout(2, 16, np.array([16, 16])) == full_rows(2, 16)  # every row 16 tokens: no padding
    assert pad.worst_layout(2, 16, None) == ((16,), (15,))  # unknown: assume padding
    assert truncate.worst_layout(2, 16, np.array([16, 16])) == full_rows(2, 16)
    assert truncate.worst_layout(2, 16, np.array([9, 16])) == ((16,), (15,))
    assert pack.worst_layout(2, 16, np.array([16, 16])) == ((8, 8), (8, 8))


def test_datamodule_answers_with_its_train_strategy(small_text_dataset):
    from lightning_seqmem import SeqMemDataModule

    for strategy, expected in (("pad", ((64,), (63,))), ("pack", ((32, 32), (32, 32)))):
        dm = SeqMemDataModule(dataset=small_text_dataset, max_length=64, micro_batch_size=2, strategy=strategy)
        assert isinstance(dm, GivesWorstBatchLayout)
        assert dm.worst_batch_layout(2, 64) == expected
