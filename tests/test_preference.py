"""Preference pairs: TRL's two-stage DPO truncation on lengths (against slicing the tokens), the checks that name
the row, and the padded pair collator against TRL 1.16's own ``DataCollatorForPreference`` on the same rows."""

import numpy as np
import pytest
import torch

from lightning_seqmem.batch import IGNORE_INDEX
from lightning_seqmem.batching.pair_collate import PreferenceCollator, check_pairs, pair_sequences
from lightning_seqmem.batching.preference import (
    CHOSEN,
    REJECTED,
    PreferenceLimits,
    identical_completions,
    preference_spans,
    sequence_spans,
)


def text_pairs(tokenizer, n=12):
    """Pairs of real text through the built-in tokenizer: a question, a fitting answer and a worse one."""
    topics = ["a list", "a dict", "a generator", "the GIL", "a context manager", "a decorator"]
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    pairs = []
    for i in range(n):
        topic = topics[i % len(topics)]
        pairs.append(
            {
                "prompt_ids": enc(f"Question {i}: what is {topic} in Python?" + " Explain briefly." * (i % 3)),
                "chosen_ids": enc(f"{topic.capitalize()} is a built-in concept." + " It is documented." * (i % 4)),
                "rejected_ids": enc("No idea." + " Maybe." * (i % 5)),
            }
        )
    return pairs


def _slice_reference(prompt, completion, limits):
    """One sequence truncated as TRL's guide says, on the tokens: ``(kept prompt, kept completion)``."""
    if limits.max_prompt_length is not None:
        prompt = prompt[max(len(prompt) - limits.max_prompt_length, 0) :]
    if limits.max_completion_length is not None:
        completion = completion[: limits.max_completion_length]
    tagged = [("p", t) for t in prompt] + [("c", t) for t in completion]
    if limits.max_length is not None:  # DataCollatorForPreference's slice
        tagged = tagged[: limits.max_length] if limits.truncation_mode == "keep_start" else tagged[-limits.max_length :]
    return [t for k, t in tagged if k == "p"], [t for k, t in tagged if k == "c"]


LIMITS = [
    PreferenceLimits(None),
    PreferenceLimits(12),
    PreferenceLimits(12, truncation_mode="keep_end"),
    PreferenceLimits(12, max_prompt_length=5, max_completion_length=6),
    PreferenceLimits(12, max_prompt_length=9, max_completion_length=9, truncation_mode="keep_end"),
    PreferenceLimits(16, max_completion_length=3, truncation_mode="keep_end"),
]


@pytest.mark.parametrize("limits", LIMITS, ids=str)
def test_spans_equal_truncating_the_tokens(limits):
    rng = np.random.default_rng(0)
    rows = 300
    p = rng.integers(0, 13 if limits.max_prompt_length else 12, rows)
    c = rng.integers(1, 20, (2, rows))
    spans = preference_spans(p, c[0], c[1], limits)
    for i in range(rows):
        prompt = list(range(p[i]))  # a token is its position: a kept slice shows where it starts
        for side in (CHOSEN, REJECTED):
            kept_p, kept_c = _slice_reference(prompt, list(range(c[side, i])), limits)
            start, n = spans.prompt_start[side, i], spans.prompt_kept[side, i]
            assert list(range(start, start + n)) == kept_p, (i, side)
            start, n = spans.completion_start[side, i], spans.completion_kept[side, i]
            assert list(range(start, start + n)) == kept_c, (i, side)
    dropped = spans.dropped()
    assert dropped["prompt_tokens_truncated"] == int((2 * p - spans.prompt_kept.sum(0)).sum())
    assert dropped["chosen_tokens_truncated"] + dropped["rejected_tokens_truncated"] == int(
        c.sum() - spans.completion_kept.sum()
    )
    assert dropped["tokens_truncated"] == int(2 * p.sum() + c.sum() - spans.sequence_lengths.sum())
    assert dropped["rows_without_completion"] == int(spans.lost.sum())


def test_sequence_spans_is_trls_slice():
    p_start, p_kept, c_start, c_kept = sequence_spans(np.array([4, 4, 9]), np.array([3, 9, 2]), 8, "keep_end")
    # keep_end cuts the prompt's start first, then the completion's start (a completion longer than max_length).
    assert p_start.tolist() == [0, 4, 3] and p_kept.tolist() == [4, 0, 6]
    assert c_start.tolist() == [0, 1, 0] and c_kept.tolist() == [3, 8, 2]


def test_a_pair_that_loses_a_completion_is_counted_warned_and_refused_by_the_collator():
    limits = PreferenceLimits(6)
    pairs = [
        {"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4]},
        {"prompt_ids": [1] * 6, "chosen_ids": [3], "rejected_ids": [4, 5]},
    ]  # the prompt fills max_length
    with pytest.warns(UserWarning, match=r"1 pair\(s\) lose a whole completion to truncation \(row 11\)"):
        spans = check_pairs(pairs, limits, first_row=10)
    assert spans.lost.tolist() == [False, True] and spans.dropped()["rows_without_completion"] == 1
    assert spans.dropped()["rows_chosen_equals_rejected"] == 0  # two lost completions are not a tie
    with pytest.raises(ValueError, match="row 1 of the batch lost a whole completion"):
        PreferenceCollator(0, limits)(pairs)
    PreferenceCollator(0, limits)([p for p, lost in zip(pairs, spans.lost) if not lost])


def test_bad_pairs_name_their_row():
    good = {"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4]}
    limits = PreferenceLimits(8)
    with pytest.raises(ValueError, match=r"row 5: the pair has no 'rejected_ids'"):
        check_pairs([good, {"prompt_ids": [1], "chosen_ids": [2]}], limits, first_row=4)
    with pytest.raises(ValueError, match=r"row 0: the pair has no 'chosen_ids'"):
        check_pairs([{**good, "chosen_ids": None}], limits)
    with pytest.raises(ValueError, match=r"rows 1, 2: empty rejected completion"):
        check_pairs([good, {**good, "rejected_ids": []}, {**good, "rejected_ids": []}], limits)
    with pytest.raises(ValueError, match=r"row 1: the prompt alone is longer than max_length=8"):
        check_pairs([good, {**good, "prompt_ids": list(range(9))}], PreferenceLimits(8, on_overlong_prompt="error"))
    # A prompt limit below max_length makes the same row fine: the prompt keeps its end.
    spans = check_pairs([good, {**good, "prompt_ids": list(range(9))}], PreferenceLimits(8, max_prompt_length=4))
    assert spans.prompt_start[:, 1].tolist() == [5, 5] and spans.dropped()["prompt_tokens_truncated"] == 10
    # A missing prompt is an empty one (the completion then starts the sequence).
    assert check_pairs([{"chosen_ids": [3], "rejected_ids": [4]}], limits).prompt_kept.tolist() == [[0], [0]]


def test_identical_pairs_are_counted_and_warned():
    pairs = [
        {"prompt_ids": [1], "chosen_ids": [3, 4], "rejected_ids": [3, 4]},
        {"prompt_ids": [1], "chosen_ids": [3, 4], "rejected_ids": [3, 5]},
        {"prompt_ids": [1], "chosen_ids": [3], "rejected_ids": [3, 4]},
    ]
    with pytest.warns(UserWarning, match=r"1 pair\(s\) with chosen == rejected \(row 0\): no preference signal"):
        spans = check_pairs(pairs, PreferenceLimits(None))
    assert spans.identical.tolist() == [True, False, False] and spans.dropped()["rows_chosen_equals_rejected"] == 1
    # Completions that differ only in what truncation cuts carry no signal either.
    with pytest.warns(UserWarning, match=r"3 pair\(s\) with chosen == rejected \(rows 0, 1, 2\)"):
        spans = check_pairs(pairs, PreferenceLimits(None, max_completion_length=1))


def test_identical_completions_vectorised_agrees_with_comparing_rows():
    rng = np.random.default_rng(1)
    chosen = [rng.integers(0, 3, rng.integers(1, 4)) for _ in range(500)]
    rejected = [c.copy() if i % 3 == 0 else rng.integers(0, 3, rng.integers(1, 4)) for i, c in enumerate(chosen)]
    flat = lambda rows: (np.concatenate(rows), np.concatenate([[0], np.cumsum([len(r) for r in rows])]))  # noqa: E731
    expected = [np.array_equal(a, b) for a, b in zip(chosen, rejected)]
    assert identical_completions(*flat(chosen), *flat(rejected)).tolist() == expected


def test_limits_are_checked():
    with pytest.raises(ValueError, match="truncation_mode='keep_middle' is not valid"):
        PreferenceLimits(8, truncation_mode="keep_middle")
    with pytest.raises(ValueError, match=r"max_prompt_length \(8\) >= max_length \(8\) leaves no room"):
        PreferenceLimits(8, max_prompt_length=8)
    with pytest.raises(ValueError, match="max_completion_length=0 must be >= 1"):
        PreferenceLimits(8, max_completion_length=0)
    with pytest.raises(ValueError, match="max_length=1 is too small"):
        PreferenceLimits(1)


# ---------------------------------------------------------------------------------------- padded: TRL's layout
@pytest.mark.parametrize(
    "max_length,mode,multiple",
    [
        (None, "keep_start", None),
        (32, "keep_start", None),
        (32, "keep_end", None),
        (40, "keep_start", 8),
        (None, "keep_end", 8),
        (32, "keep_end", 4),
    ],
)
def test_padded_batch_equals_trls_collator(tokenizer, max_length, mode, multiple):
    trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")
    pairs = text_pairs(tokenizer)
    if max_length is not None:  # sequences really are cut, under both modes
        assert max(len(p["prompt_ids"]) + len(p["chosen_ids"]) for p in pairs) > max_length
    for i, p in enumerate(pairs):
        p["ref_chosen_logps"], p["ref_rejected_logps"] = -1.5 * i, -2.0 * i
    ours = PreferenceCollator(
        tokenizer.pad_token_id, PreferenceLimits(max_length, truncation_mode=mode), pad_to_multiple_of=multiple
    )(pairs)
    theirs = trl_dpo.DataCollatorForPreference(
        pad_token_id=tokenizer.pad_token_id, max_length=max_length, truncation_mode=mode, pad_to_multiple_of=multiple
    )(pairs)
    assert set(theirs) <= set(ours) and ours["input_ids"].shape[0] == 2 * len(pairs)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key
    labels = ours["input_ids"].masked_fill(ours["completion_mask"] == 0, IGNORE_INDEX)
    assert torch.equal(ours["labels"], labels)  # what TRL's loss passes to the model as labels


def test_padded_shapes_follow_the_padding_settings(tokenizer):
    pairs = text_pairs(tokenizer, n=4)
    limits = PreferenceLimits(40, max_prompt_length=12, max_completion_length=10)
    longest = max(len(s) for s in pair_sequences(pairs, limits)[0])
    assert PreferenceCollator(0, limits, pad_to_multiple_of=None)(pairs)["input_ids"].shape == (8, longest)
    assert PreferenceCollator(0, limits, pad_to_multiple_of=8)(pairs)["input_ids"].shape == (8, -(-longest // 8) * 8)
    assert PreferenceCollator(0, limits, pad_to_max_length=True)(pairs)["input_ids"].shape == (8, 40)
    # The multiple never pads past max_length (a shape the memory plan did not count).
    capped = PreferenceCollator(0, PreferenceLimits(22, max_prompt_length=12), pad_to_multiple_of=16)(pairs)
    assert capped["input_ids"].shape[1] <= 22
    assert "labels" not in PreferenceCollator(0, limits, return_labels=False)(pairs)
    with pytest.raises(ValueError, match="pad_to_max_length=True needs max_length"):
        PreferenceCollator(0, PreferenceLimits(None), pad_to_max_length=True)
