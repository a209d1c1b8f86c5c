"""Truncation: counting, sides, and prompt/completion truncation on hand-worked examples."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_seqmem.batching.truncation import (
    PromptCompletionLimits,
    count_truncated,
    prompt_completion_example,
    prompt_completion_spans,
    truncate_ids,
    truncate_prompt_completion,
)


def test_count_truncated():
    assert count_truncated([3, 10, 7, 0], 5) == 7
    assert count_truncated([3, 10], None) == 0
    assert count_truncated([], 5) == 0


def test_truncation_sides():
    assert truncate_ids([1, 2, 3, 4], 2, "right") == [1, 2]
    assert truncate_ids([1, 2, 3, 4], 2, "left") == [3, 4]
    assert truncate_ids([1, 2], 5) == [1, 2]


def test_prompt_keeps_its_end_and_completion_its_start():
    lim = PromptCompletionLimits(max_length=6, max_prompt_length=3, max_completion_length=3)
    assert truncate_prompt_completion([1, 2, 3, 4, 5], [6, 7, 8, 9], lim) == ([3, 4, 5], [6, 7, 8])


def test_max_length_applies_after_the_part_limits():
    # right (default): the completion's end goes first; left: the prompt's start goes first.
    right = PromptCompletionLimits(max_length=5, max_prompt_length=4)
    assert truncate_prompt_completion([1, 2, 3, 4, 5], [6, 7, 8], right) == ([2, 3, 4, 5], [6])
    left = PromptCompletionLimits(max_length=5, max_prompt_length=4, truncation_side="left")
    assert truncate_prompt_completion([1, 2, 3, 4, 5], [6, 7, 8], left) == ([4, 5], [6, 7, 8])


def test_completion_only_labels_are_switchable():
    lim = PromptCompletionLimits(max_length=8)
    ex = prompt_completion_example([1, 2, 3], [4, 5], lim)
    assert ex["input_ids"] == [1, 2, 3, 4, 5] and ex["labels"] == [-100, -100, -100, 4, 5]
    ex = prompt_completion_example([1, 2, 3], [4, 5], lim, completion_only_loss=False)
    assert ex["labels"] == [1, 2, 3, 4, 5]


def test_a_completion_cut_to_nothing_is_flagged():
    lim = PromptCompletionLimits(max_length=3)
    ex = prompt_completion_example([1, 2, 3, 4], [5, 6], lim)
    assert ex["completion_length"] == 0 and ex["num_truncated"] == 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(max_length=8, max_prompt_length=5, max_completion_length=4),
            r"max_prompt_length \(5\) \+ max_completion_length \(4\) > max_length \(8\)",
        ),
        (dict(max_length=1), "max_length=1 is too small"),
        (dict(max_length=8, truncation_side="middle"), r"truncation_side='middle' is not valid; use one of"),
        (dict(max_length=8, max_prompt_length=0), "max_prompt_length=0 must be >= 1"),
    ],
)
def test_bad_limits(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PromptCompletionLimits(**kwargs)


@settings(max_examples=100, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 9), max_size=20),
    completion=st.lists(st.integers(0, 9), max_size=20),
    max_length=st.integers(2, 30),
    mp=st.none() | st.integers(1, 10),
    mc=st.none() | st.integers(1, 10),
    side=st.sampled_from(["right", "left"]),
)
def test_prompt_completion_conserves_tokens(prompt, completion, max_length, mp, mc, side):
    if mp is not None and mc is not None and mp + mc > max_length:
        return
    lim = PromptCompletionLimits(max_length, mp, mc, side)
    p, c = truncate_prompt_completion(prompt, completion, lim)
    assert len(p) + len(c) <= max_length
    kept_end = prompt[len(prompt) - min(len(prompt), mp or len(prompt)) :]  # what max_prompt_length keeps
    assert p == (kept_end[: len(p)] if side == "right" else kept_end[len(kept_end) - len(p) :])
    assert completion[: len(c)] == c
    ex = prompt_completion_example(prompt, completion, lim)
    assert ex["num_truncated"] == len(prompt) + len(completion) - len(p) - len(c)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), min_size=1, max_size=20),
    max_length=st.one_of(st.none(), st.integers(2, 40)),
    max_prompt=st.one_of(st.none(), st.integers(1, 20)),
    max_completion=st.one_of(st.none(), st.integers(1, 20)),
    side=st.sampled_from(["right", "left"]),
)
def test_vectorised_spans_match_the_per_row_truncation(rows, max_length, max_prompt, max_completion, side):
    try:
        lim = PromptCompletionLimits(max_length, max_prompt, max_completion, side)
    except ValueError:
        return  # limits that cannot fit: rejected before any row is seen
    plen, clen = (np.asarray(x) for x in zip(*rows))
    offset, p_kept, c_kept = prompt_completion_spans(plen, clen, lim)
    for i, (p, c) in enumerate(rows):
        prompt, completion = list(range(100, 100 + p)), list(range(200, 200 + c))
        want_p, want_c = truncate_prompt_completion(prompt, completion, lim)
        assert prompt[offset[i] : offset[i] + p_kept[i]] == want_p and completion[: c_kept[i]] == want_c
