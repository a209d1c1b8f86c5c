"""Memory, planning and warmup know preference pairs: the warmup cuts both sequences of a pair alike (padded and
packed pairs give the same log-probabilities after it), the pre-allocator's worst batch is a valid pair batch, and
``seqmem-train data=preference model=dpo`` runs with warmup and pre-allocation on."""

import sys
from pathlib import Path

import pytest
import torch

from lightning_seqmem.batch import COMPLETION_MASK, SEQUENCE_INDEX
from lightning_seqmem.batching.pair_collate import PreferenceCollator
from lightning_seqmem.memory.worst_batch import make_dummy_batch
from lightning_seqmem.training.preference_loss import sequence_logps
from lightning_seqmem.warmup import set_batch_sequence_length

sys.path.insert(0, str(Path(__file__).parent))
from test_preference import text_pairs  # noqa: E402
from test_preference_packing import LIMITS, _llama, _packed  # noqa: E402


def _logps(model, batch):
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    with torch.no_grad():
        return sequence_logps(model(**inputs, use_cache=False).logits, batch)


@pytest.mark.parametrize("length", [6, 13, 40])
def test_warmup_cuts_both_sequences_of_a_pair_alike(tokenizer, length):
    pairs = text_pairs(tokenizer)
    for i, p in enumerate(pairs):
        p["ref_chosen_logps"], p["ref_rejected_logps"] = -1.0 * i, -2.0 * i
    packed, order = _packed(pairs)
    padded = PreferenceCollator(0, LIMITS, pad_to_multiple_of=None)([pairs[k] for k in order])
    ref = packed["ref_chosen_logps"].clone()
    set_batch_sequence_length(padded, length, pad_token_id=0)
    set_batch_sequence_length(packed, length, pad_token_id=0)
    assert padded["input_ids"].shape[1] <= length and torch.equal(packed["ref_chosen_logps"], ref)
    # Every sequence of the packed batch kept its first `length` tokens, at positions 0..length-1, and its number.
    lengths = torch.bincount(packed[SEQUENCE_INDEX][packed[SEQUENCE_INDEX] >= 0], minlength=2 * len(pairs))
    assert torch.equal(lengths, padded["attention_mask"].sum(1))
    assert int(packed["position_ids"][packed[SEQUENCE_INDEX] >= 0].max()) < length
    model = _llama()
    for got, expected in zip(_logps(model, packed), _logps(model, padded)):
        assert (got - expected).abs().max().item() <= 1e-5


def test_warmup_refuses_to_reshape_pairs(tokenizer):
    packed, _ = _packed(text_pairs(tokenizer, n=4))
    with pytest.raises(ValueError, match="separate the chosen and rejected"):
        set_batch_sequence_length(packed, 8, truncate=False)


@pytest.mark.parametrize(
    "keys,rows",
    [
        (("input_ids", "attention_mask", COMPLETION_MASK, "labels"), 8),
        (("input_ids", "labels", "position_ids", COMPLETION_MASK, SEQUENCE_INDEX), 4),
    ],
)
def test_the_worst_batch_is_a_pair_batch(keys, rows):
    from lightning_seqmem.batch import packed_rows, padded_rows

    layout = (packed_rows if SEQUENCE_INDEX in keys else padded_rows)(rows, 64)
    batch = make_dummy_batch(rows, 64, keys, vocab_size=50, layout=layout)
    logits = torch.randn(rows, 64, 50)
    chosen, rejected = sequence_logps(logits, batch)  # an even number of sequences, completion tokens scored
    assert chosen.shape == rejected.shape and (chosen < 0).all()


@pytest.mark.slow
def test_seqmem_train_data_preference_model_dpo(tmp_path):
    from test_train import run_in_process

    summary = run_in_process(
        tmp_path,
        [
            "data=preference",
            "model=dpo",
            "data.max_prompt_length=24",
            "data.micro_batch_size=4",
            "callbacks.seq_warmup.duration=0.5",
            "callbacks.seq_warmup.max_seq_length=128",  # the DataModule's length: warmup ends at full length
        ],
    )
    assert summary["optimizer_steps"] == 4 and summary["strategy"] == "pack_bfd (pairs)"
    assert summary["final_val_loss"] > 0 and summary["real_tokens_trained"] > 0
