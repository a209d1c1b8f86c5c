"""Padding-free pairs and their log-probabilities.

Pairs packed whole into rows (best fit on pair lengths); per-sequence bookkeeping that recovers the padded batch's
sequences; and the proof the issue asks for: the same tiny Llama (random weights, fp32, built from a config) on
the same pairs gives per-sequence completion log-probabilities within 1e-5 padded vs packed, under SDPA
(``position_ids``, no ``attention_mask``) and under ``torch_varlen`` (torch's varlen kernel replaced by the exact
CPU reference of ``_flash_reference``, as in ``test_flash_packing.py``; the real kernel is CUDA only).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _flash_reference import CALLS, use_reference_torch_varlen
from test_preference import text_pairs
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_seqmem.batch import PREFERENCE_PACK_KEYS
from lightning_seqmem.batching.bin_packing import best_fit_decreasing
from lightning_seqmem.batching.pair_collate import PreferenceCollator, check_pairs
from lightning_seqmem.batching.pair_packing import PackedPairCollator, plan_pair_rows
from lightning_seqmem.batching.preference import PreferenceLimits
from lightning_seqmem.training.attention import register_varlen_attention
from lightning_seqmem.training.preference_loss import dpo_loss, sequence_logps, token_logps
from lightning_seqmem.training.varlen import batch_varlen_kwargs, flash_varlen_kwargs

LIMITS = PreferenceLimits(40, max_prompt_length=24, truncation_mode="keep_start")
ROW = 4 * LIMITS.max_length  # several pairs per row (2 * max_length holds any one pair)


def _packed(pairs, limits=LIMITS, row_length=ROW, **kwargs):
    spans = check_pairs(pairs, limits)
    order, offsets = plan_pair_rows(spans.pair_lengths, row_length)
    rows = [[pairs[k] for k in order[a:b]] for a, b in zip(offsets[:-1], offsets[1:])]
    return PackedPairCollator(0, limits, row_length, **kwargs)(rows), order


def test_plan_keeps_every_pair_whole_in_one_row():
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 80, 500)
    pairs, offsets = plan_pair_rows(lengths, 80)
    assert sorted(pairs.tolist()) == list(range(500))  # every pair exactly once
    row_sums = np.add.reduceat(lengths[pairs], offsets[:-1])
    assert (row_sums <= 80).all()
    assert len(offsets) - 1 <= len(np.unique(best_fit_decreasing(lengths, 80)[1]))  # never worse than best fit
    with pytest.raises(ValueError, match=r"row 12: the pair \(chosen \+ rejected\) is longer than row_length=80"):
        plan_pair_rows(np.array([81]), 80, first_row=12)
    with pytest.raises(ValueError, match="row 1: empty pair"):
        plan_pair_rows(np.array([3, 0]), 80)


def test_packed_rows_hold_the_padded_sequences(tokenizer):
    pairs = text_pairs(tokenizer)
    for i, p in enumerate(pairs):
        p["ref_chosen_logps"], p["ref_rejected_logps"] = -1.0 * i, -2.0 * i
    packed, order = _packed(pairs)
    padded = PreferenceCollator(0, LIMITS, pad_to_multiple_of=None)([pairs[k] for k in order])
    assert set(PREFERENCE_PACK_KEYS) <= set(packed) and "attention_mask" not in packed
    assert packed["input_ids"].shape[0] < len(pairs)  # rows really hold several pairs
    # Sequence s of the packed batch is row s of the padded one: tokens, positions, completion tokens.
    for s in range(2 * len(pairs)):
        where = packed["sequence_index"] == s
        real = padded["attention_mask"][s].bool()
        assert torch.equal(packed["input_ids"][where], padded["input_ids"][s, real])
        assert packed["position_ids"][where].tolist() == list(range(int(real.sum())))
        completion = padded["completion_mask"][s, real].clone()
        completion[0] = 0  # a sequence's first token is never predicted (the token before it is another sequence)
        assert torch.equal(packed["completion_mask"][where], completion)
    # Both sequences of a pair share a row, chosen then rejected; padding is -1 with label -100.
    rows = [set(torch.unique(r[r >= 0] % len(pairs)).tolist()) for r in packed["sequence_index"]]
    assert sum(len(r) for r in rows) == len(pairs)
    padding = packed["sequence_index"] == -1
    assert (packed["labels"][padding] == -100).all() and (packed["input_ids"][padding] == 0).all()
    assert torch.equal(packed["labels"] != -100, packed["completion_mask"].bool())
    assert torch.equal(packed["ref_chosen_logps"], padded["ref_chosen_logps"])


def test_packed_shape_settings(tokenizer):
    pairs = text_pairs(tokenizer, n=6)
    full, _ = _packed(pairs)
    assert full["input_ids"].shape[1] == ROW
    short, _ = _packed(pairs, pad_to_longest=True, pad_to_multiple_of=16, return_cu_seqlens=True)
    assert short["input_ids"].shape[1] % 16 == 0 and short["input_ids"].shape[1] <= ROW
    assert short["cu_seqlens"].dtype == torch.int32


# ---------------------------------------------------------------------------------- log-probabilities and loss
def _llama(attn="sdpa", vocab=4096):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * ROW,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(cfg).eval()


def test_sequence_logps_equal_trls_per_token_sum(tokenizer):
    trl_utils = pytest.importorskip("trl.trainer.utils")
    batch = PreferenceCollator(0, LIMITS)(text_pairs(tokenizer, n=4))
    logits = torch.randn(*batch["input_ids"].shape, 4096, generator=torch.Generator().manual_seed(0))
    # TRL's own computation: per-token log-probs of the next token, summed under the shifted completion mask.
    per_token = trl_utils.selective_log_softmax(logits[:, :-1], batch["input_ids"][:, 1:])
    expected = (per_token * batch["completion_mask"][:, 1:]).double().sum(1).chunk(2)
    chosen, rejected = sequence_logps(logits, batch)
    assert chosen.dtype == torch.float64  # summed in float64: fp32 rounding of the sum exceeds 1e-5
    assert torch.allclose(chosen, expected[0], atol=1e-4) and torch.allclose(rejected, expected[1], atol=1e-4)
    assert torch.allclose(token_logps(logits, batch["input_ids"]), per_token, atol=1e-5)


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_padded_and_packed_pairs_give_the_same_logps(tokenizer, monkeypatch, mode):
    limits = PreferenceLimits(40, max_prompt_length=24, truncation_mode=mode)
    pairs = text_pairs(tokenizer)
    packed, order = _packed(pairs, limits)
    padded = PreferenceCollator(0, limits)([pairs[k] for k in order])
    sdpa = _llama("sdpa")
    with torch.no_grad():
        reference = sequence_logps(
            sdpa(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"], use_cache=False).logits, padded
        )
        results = {
            "packed sdpa": sequence_logps(
                sdpa(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits, packed
            )
        }
        # Negative control: packed rows without position_ids attend across sequences.
        leaky = sequence_logps(sdpa(input_ids=packed["input_ids"], use_cache=False).logits, packed)
        use_reference_torch_varlen(monkeypatch)
        varlen = _llama(register_varlen_attention())
        varlen.load_state_dict(sdpa.state_dict())
        bf16 = {}
    # The varlen kernel takes fp16/bf16 only: under bf16-mixed, where "auto" picks it.
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        bf16["padded sdpa"] = sequence_logps(
            sdpa(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"], use_cache=False).logits, padded
        )
        bf16["padded varlen"] = sequence_logps(
            varlen(
                input_ids=padded["input_ids"],
                attention_mask=padded["attention_mask"],
                use_cache=False,
                **batch_varlen_kwargs(padded),
            ).logits,
            padded,
        )
        bf16["packed varlen"] = sequence_logps(
            varlen(
                input_ids=packed["input_ids"],
                position_ids=packed["position_ids"],
                use_cache=False,
                **flash_varlen_kwargs(packed["position_ids"]),
            ).logits,
            packed,
        )
    assert CALLS and all(n > len(pairs) for _, n in CALLS)  # the varlen kernel ran, one segment per sequence
    for name, (chosen, rejected) in results.items():
        error = max((chosen - reference[0]).abs().max().item(), (rejected - reference[1]).abs().max().item())
        assert error <= 1e-5, (name, error)
    # Packed and padded pairs through the varlen kernel: the same bf16 numbers; within bf16 rounding of the fp32
    # reference (SDPA's own bf16 error is about 2e-3, a leak across sequences about 0.15).
    assert torch.equal(torch.stack(bf16["padded varlen"]), torch.stack(bf16["packed varlen"]))
    for name, (chosen, rejected) in bf16.items():
        error = max((chosen - reference[0]).abs().max().item(), (rejected - reference[1]).abs().max().item())
        assert error <= 1e-2, (name, error)
    assert (leaky[0] - reference[0]).abs().max().item() > 1e-3


def test_dpo_loss_is_trls_sigmoid_loss():
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(8, generator=g) * 5 for _ in range(4))
    out = dpo_loss(pc, pr, rc, rr, beta=0.2)
    assert torch.allclose(out.losses, -F.logsigmoid(0.2 * ((pc - rc) - (pr - rr))))
    assert torch.allclose(out.chosen_rewards, 0.2 * (pc - rc)) and torch.allclose(out.rejected_rewards, 0.2 * (pr - rr))
    smoothed = dpo_loss(pc, pr, rc, rr, beta=0.2, label_smoothing=0.1).losses
    margin = 0.2 * ((pc - rc) - (pr - rr))
    assert torch.allclose(smoothed, -0.9 * F.logsigmoid(margin) - 0.1 * F.logsigmoid(-margin))
    # The policy equal to the reference: log 2 per pair, whatever the log-probabilities.
    assert torch.allclose(dpo_loss(pc, pr, pc, pr).losses, torch.full((8,), float(np.log(2))))
    with pytest.raises(ValueError, match="beta=0 must be > 0"):
        dpo_loss(pc, pr, rc, rr, beta=0)
    with pytest.raises(ValueError, match=r"label_smoothing=0.5 must be in \[0, 0.5\)"):
        dpo_loss(pc, pr, rc, rr, label_smoothing=0.5)


def test_one_dpo_step_on_packed_pairs_prefers_the_chosen_answers(tokenizer):
    """Against a frozen reference copy: the gradient of the packed loss moves the policy's margin the right way."""
    pairs = text_pairs(tokenizer, n=6)
    packed, _ = _packed(pairs)
    policy, reference = _llama(), _llama()
    inputs = {"input_ids": packed["input_ids"], "position_ids": packed["position_ids"], "use_cache": False}
    with torch.no_grad():
        ref = sequence_logps(reference(**inputs).logits, packed)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    margins = []
    for _ in range(2):
        chosen, rejected = sequence_logps(policy(**inputs).logits, packed)
        out = dpo_loss(chosen, rejected, *ref)
        margins.append((out.chosen_rewards - out.rejected_rewards).mean().item())
        optimizer.zero_grad()
        out.losses.mean().backward()
        optimizer.step()
    assert margins[0] == pytest.approx(0.0, abs=1e-5) and margins[1] > margins[0]
