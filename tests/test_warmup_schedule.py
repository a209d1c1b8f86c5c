"""Tests for the sequence-length warmup schedule (pure function)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_seqmem.warmup.schedule import seq_length_at, warmup_lengths, warmup_steps


def schedule(total, duration=0.3, lo=8, hi=1024, step=8, **kwargs):
    return [seq_length_at(s, total, duration, lo, hi, step, **kwargs) for s in range(total + 3)]


def test_linear_values():
    assert schedule(10, 0.5, 8, 64)[:7] == [8, 16, 24, 40, 48, 64, 64]


@pytest.mark.parametrize("total", [1, 2, 3, 5, 10, 100, 423, 424, 1000])
def test_short_and_long_runs_start_at_min_and_reach_max(total):
    # Composer divides by zero below 424 batches with these defaults; the schedule must not.
    lengths = schedule(total, 0.3, 8, 1024, 8)
    warmup = warmup_steps(total, 0.3)
    assert lengths[0] == 8
    assert all(v == 1024 for v in lengths[warmup:])
    assert all(v < 1024 for v in lengths[:warmup])
    assert lengths == sorted(lengths)


def test_duration_zero_is_max_from_step_zero():
    assert set(schedule(10, 0.0)) == {1024}


def test_duration_one_reaches_max_at_the_end():
    lengths = schedule(10, 1.0, 8, 88, 8)
    assert lengths[:10] == [8, 16, 24, 32, 40, 48, 56, 64, 72, 80]
    assert lengths[10:] == [88, 88, 88]


def test_min_equals_max():
    assert set(schedule(10, 0.5, 64, 64)) == {64}


def test_max_minus_min_not_multiple_of_step_size():
    lengths = schedule(20, 0.5, 8, 60, 16)
    assert lengths[0] == 8 and lengths[10:] == [60] * 13
    assert all(v == 8 or v % 16 == 0 for v in lengths[:10])


def test_min_not_multiple_of_step_size():
    lengths = schedule(40, 1.0, 5, 30, 8)
    assert lengths[0] == 5 and lengths[-1] == 30
    assert set(lengths) <= set(warmup_lengths(5, 30, 8)) == {5, 8, 16, 24, 30}


def test_float_noise_in_duration():
    assert warmup_steps(10, 0.7) == 7
    assert schedule(10, 0.7, 8, 64)[7] == 64


def test_fixed_root_grows_faster_then_slower():
    linear = schedule(100, 1.0, 8, 1024, 8)
    root = schedule(100, 1.0, 8, 1024, 8, curve="fixed_root", root_degree=2)
    assert root[0] == 8 and root[100] == 1024
    assert all(r >= lin for r, lin in zip(root, linear))
    assert root[25] == 512  # DeepSpeed: 8 + sqrt(0.25) * 1016 = 516 -> 512
    assert root == sorted(root)


@settings(max_examples=200, deadline=None)
@given(
    total=st.integers(1, 600),
    duration=st.floats(0, 1),
    lo=st.integers(1, 256),
    extra=st.integers(0, 1024),
    step=st.integers(1, 128),
    curve=st.sampled_from(["linear", "fixed_root"]),
    root=st.integers(1, 4),
)
def test_schedule_properties(total, duration, lo, extra, step, curve, root):
    hi = lo + extra
    lengths = [seq_length_at(s, total, duration, lo, hi, step, curve, root) for s in range(total + 2)]
    warmup = warmup_steps(total, duration)
    assert lengths == sorted(lengths), "never decreasing"
    assert all(lo <= v <= hi for v in lengths)
    assert lengths[0] == (lo if warmup > 0 and lo < hi else hi)
    assert all(v == hi for v in lengths[warmup:])
    assert set(lengths) <= set(warmup_lengths(lo, hi, step))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"duration": 1.5}, r"\[0, 1\]"),
        ({"duration": -0.1}, r"\[0, 1\]"),
        ({"min_seq_length": 0}, "min_seq_length must be >= 1"),
        ({"min_seq_length": 64, "max_seq_length": 32}, "must be <= max_seq_length"),
        ({"step_size": 0}, "step_size must be >= 1"),
        ({"curve": "cosine"}, "curve must be one of"),
        ({"root_degree": 0}, "root_degree"),
        ({"step": -1}, "step must be >= 0"),
        ({"total_steps": 0}, "max_steps"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {
        "step": 0,
        "total_steps": 10,
        "duration": 0.3,
        "min_seq_length": 8,
        "max_seq_length": 64,
        "step_size": 8,
    } | kwargs
    with pytest.raises(ValueError, match=match):
        seq_length_at(**args)


def test_non_int_lengths_rejected():
    with pytest.raises(TypeError, match="int"):
        seq_length_at(0, 10, 0.3, 8.0, 64, 8)
