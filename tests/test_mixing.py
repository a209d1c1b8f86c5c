"""The mixed order (``mixing``): the share bound at every step, stop/repeat accounting, resume at any cut, the
sampler's ranks, and every bad ``Mix`` named by its source."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_seqmem import Mix
from lightning_seqmem.mixing.interleave import Interleaver, interleave, pass_order
from lightning_seqmem.mixing.sampler import MixedBatchSampler


def _sizes(seed, counts, ranges):
    rng = np.random.default_rng(seed)
    return [rng.integers(lo, hi + 1, size=n) for n, (lo, hi) in zip(counts, ranges)]


def _worst(weights, sizes, sources, rows):
    """The largest lag (``w T - t > 0``) and lead (``t - w T``) over every prefix, exactly (integer counts)."""
    w, served, total, lag, lead = np.asarray(weights), np.zeros(len(weights)), 0, 0.0, 0.0
    for s, r in zip(sources, rows):
        served[s] += sizes[s][r]
        total += sizes[s][r]
        deficit = w * total - served
        lag, lead = max(lag, deficit.max()), max(lead, -deficit.min())
    return lag, lead


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    k=st.integers(2, 5),
    raw=st.lists(st.floats(0.05, 1.0), min_size=5, max_size=5),
    exhausted=st.sampled_from(["stop", "repeat"]),
)
def test_every_prefix_is_within_one_row_of_every_share(seed, k, raw, exhausted):
    # Very different row sizes: some sources give full rows, others rows of a few tokens.
    counts, ranges = [20, 200, 60, 5, 90][:k], [(30, 64), (1, 4), (1, 64), (64, 64), (2, 10)][:k]
    sizes = _sizes(seed, counts, ranges)
    weights = np.asarray(raw[:k]) / sum(raw[:k])
    it = Interleaver(weights, sizes, pass_order(seed, 0, counts), exhausted)
    sources, rows = interleave(it)
    lag, lead = _worst(weights, sizes, sources, rows)
    assert lag <= 64 + 1e-6 and lead <= 64 + 1e-6
    # the lead is tighter: a source is only picked when it is not ahead, so at most (1 - w_s) of one row
    assert lead <= (1 - weights.min()) * 64 + 1e-6


def test_repeat_reads_every_source_once_and_counts_the_repeats():
    sizes = [np.full(10, 64), np.full(160, 4)]  # 640 tokens each; the weights ask 3 times more of the first
    it = Interleaver([0.75, 0.25], sizes, pass_order(0, 0, [10, 160]), "repeat")
    sources, rows = interleave(it)
    # the order ends as the second source finishes its one pass: by then the first gave 3 x 640 tokens, +- a row
    assert it.passes[1] == 1 and abs(it.rows_served[0] - 30) <= 1 and it.passes[0] == it.rows_served[0] // 10
    counts = np.bincount(rows[sources == 0], minlength=10)  # each pass a permutation: no row a third time early
    assert counts.max() - counts.min() <= 1 and counts.sum() == it.rows_served[0]
    assert sorted(rows[sources == 1].tolist()) == list(range(160))


def test_stop_ends_when_the_first_source_runs_out_and_repeats_nothing():
    sizes = [np.full(10, 64), np.full(100, 4)]
    it = Interleaver([0.75, 0.25], sizes, pass_order(0, 0, [10, 100]), "stop")  # the first runs out first
    sources, rows = interleave(it)
    assert it.passes == [1, 0]
    assert sorted(rows[sources == 0].tolist()) == list(range(10))  # read once, all of it
    second = rows[sources == 1]
    assert len(set(second.tolist())) == len(second) < 100  # no row twice; the rest is left unread


def test_mixing_by_documents_misses_the_token_share():
    # 30 % of documents from a source whose documents are 4 times longer: 63 % of the tokens, not 30 %.
    sizes = [np.full(300, 40), np.full(1000, 10)]
    docs = [np.ones(300, dtype=np.int64), np.ones(1000, dtype=np.int64)]
    by_docs = Interleaver([0.3, 0.7], docs, pass_order(0, 0, [300, 1000]), "stop")
    sources, rows = interleave(by_docs)
    tokens = [int(sum(sizes[s][r] for r in rows[sources == s])) for s in (0, 1)]
    assert tokens[0] / sum(tokens) == pytest.approx(0.3 * 4 / (0.3 * 4 + 0.7), abs=0.01)
    assert _worst([0.3, 0.7], sizes, sources, rows)[0] > 10 * 40  # far more than one row off
    by_tokens = Interleaver([0.3, 0.7], sizes, pass_order(0, 0, [300, 1000]), "stop")
    assert max(_worst([0.3, 0.7], sizes, *interleave(by_tokens))) <= 40


@settings(max_examples=40, deadline=None)
@given(cut=st.integers(0, 400), exhausted=st.sampled_from(["stop", "repeat"]))
def test_a_resumed_interleaver_continues_exactly(cut, exhausted):
    sizes = _sizes(3, [30, 120, 8], [(20, 64), (1, 6), (64, 64)])
    order = pass_order(7, 2, [30, 120, 8])
    whole = interleave(Interleaver([0.5, 0.2, 0.3], sizes, order, exhausted))
    first = Interleaver([0.5, 0.2, 0.3], sizes, order, exhausted)
    head = interleave(first, limit=cut)
    state = first.state_dict()
    resumed = Interleaver([0.5, 0.2, 0.3], sizes, order, exhausted)
    resumed.load_state_dict(state)
    assert resumed.deficits.tolist() == first.deficits.tolist()
    tail = interleave(resumed)
    assert np.concatenate([head[0], tail[0]]).tolist() == whole[0].tolist()
    assert np.concatenate([head[1], tail[1]]).tolist() == whole[1].tolist()


def _sampler(world, rank, exhausted="repeat", **kw):
    sizes = _sizes(1, [40, 300], [(30, 64), (1, 8)])
    return MixedBatchSampler([0.4, 0.6], sizes, sizes, exhausted, 4, seed=5, num_replicas=world, rank=rank, **kw)


@pytest.mark.parametrize("exhausted", ["stop", "repeat"])
def test_two_ranks_each_hold_the_share_and_read_each_row_at_most_once_per_pass(exhausted):
    samplers = [_sampler(2, r, exhausted) for r in (0, 1)]
    batches = [list(s) for s in samplers]
    assert len(batches[0]) == len(batches[1]) == len(samplers[0])  # same count: no rank waits at the end
    lengths = np.concatenate(samplers[0].lengths)
    for s, rank_batches in zip(samplers, batches):
        rows = np.asarray([i for b in rank_batches for i in b])
        src = s.source_of(rows)
        local = rows - s.offsets[src]
        sizes = [lengths[s.offsets[0] : s.offsets[1]], lengths[s.offsets[1] :]]
        assert max(_worst([0.4, 0.6], sizes, src, local)) <= 64
    first_pass = [set(), set()]
    for s, rank_batches in zip(samplers, batches):
        counts = s.source_counts()
        for src in (0, 1):
            mine = [i for b in rank_batches for i in b if s.source_of(np.asarray([i]))[0] == src]
            head = mine[: len(range(s.rank, len(s.lengths[src]), 2))]  # the rank's first pass over its share
            assert len(set(head)) == len(head)
            assert not first_pass[src] & set(head)  # the ranks' first passes are disjoint
            first_pass[src] |= set(head)
            assert counts[src]["rows"] == len(mine)


def test_token_budget_batches_are_consecutive_rows_within_the_budget():
    s = _sampler(1, 0, max_tokens_per_batch=128, padded_length=lambda n: -(-n // 8) * 8)
    s.batch_rows = None
    lengths = np.concatenate(s.lengths)
    flat = []
    for batch in s:
        assert len(batch) * (-(-int(lengths[batch].max()) // 8) * 8) <= 128
        flat += batch
    assert flat == np.concatenate([rows for rows, _ in s.rank_plans(0)]).tolist()  # the mixed order, uncut


def test_sampler_state_carries_the_mixer_and_refuses_another_mix():
    s = _sampler(1, 0)
    it = iter(s)
    for _ in range(5):
        next(it)
    state = s.state_dict()
    assert state["batches_yielded"] == 5 and sum(state["mixer"]["rows_served"]) == 20
    again = _sampler(1, 0)
    again.load_state_dict(state)
    assert list(again) == list(s.batches())[5:]
    other = MixedBatchSampler([0.5, 0.5], s.units, s.lengths, "repeat", 4, seed=5, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="mix state"):
        other.load_state_dict(state)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"weights": {"web": 1, "cod": 1}}, r"unknown sources \['cod'\]"),
        ({"weights": {"web": 1}}, r"miss sources \['code'\]"),
        ({"weights": {"web": -0.1, "code": 1}}, "source 'web' is -0.1"),
        ({"weights": {"web": math.nan, "code": 1}}, "source 'web' is nan"),
        ({"weights": {"web": math.inf, "code": 1}}, "source 'web' is inf"),
        ({"weights": {"web": 0, "code": 0}}, "sum to 0"),
        ({"exhausted": "repeats"}, r"exhausted=...\)='repeats' is not valid"),
        ({"by": "token"}, r"by=...\)='token' is not valid"),
    ],
)
def test_bad_mix_is_refused_naming_the_source(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Mix(sources={"web": "builtin", "code": "builtin"}, **kwargs)


def test_mix_normalises_weights_and_reads_source_options():
    mix = Mix({"web": "builtin", "code": {"dataset": "x", "text_column": "content"}}, {"web": 3, "code": 1})
    assert mix.weights == (0.75, 0.25) and mix.sources[1].text_column == "content"
    with pytest.raises(ValueError, match=r"source 'code': unknown options \['column'\]"):
        Mix({"code": {"dataset": "x", "column": "c"}})
    with pytest.raises(ValueError, match="at least one source"):
        Mix({})


@settings(max_examples=12, deadline=None)
@given(cut=st.integers(0, 60), exhausted=st.sampled_from(["stop", "repeat"]), world=st.sampled_from([1, 2]))
def test_the_sampler_resumes_at_any_batch_on_every_rank(cut, exhausted, world):
    for rank in range(world):
        s = _sampler(world, rank, exhausted)
        s.set_epoch(1)
        batches = list(s.batches())
        cut = min(cut, len(batches))
        it = iter(s)
        for _ in range(cut):
            next(it)
        again = _sampler(world, rank, exhausted)
        again.load_state_dict(s.state_dict())
        assert again.epoch == 1 and list(again) == batches[cut:]


@pytest.mark.parametrize("exhausted", ["stop", "repeat"])
def test_the_fast_loop_is_the_order_of_single_steps(exhausted):
    sizes = _sizes(4, [40, 150, 9], [(20, 64), (1, 6), (64, 64)])
    order = pass_order(1, 0, [40, 150, 9])
    fast, slow = (Interleaver([0.2, 0.5, 0.3], sizes, order, exhausted) for _ in range(2))
    steps = []
    while not slow.done:
        steps.append(slow.step())
    while len(steps) < 500 and exhausted == "repeat":  # past the end, as a shorter rank reads on
        steps.append(slow.step(keep_going=True))
    ran = fast.run()
    if exhausted == "repeat":
        more = fast.run(500 - len(ran[0]), keep_going=True)
        ran = (ran[0] + more[0], ran[1] + more[1])
    assert list(zip(*ran)) == steps and fast.state_dict() == slow.state_dict()


def test_the_benchmark_prints_its_table_and_the_bound_holds(monkeypatch, capsys):
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "mixing.py"
    monkeypatch.setattr(sys, "argv", ["mixing.py", "--rows", "3000"])
    runpy.run_path(str(script), run_name="__main__")
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 ")]
    assert rows and float(rows[0][4]) <= 1.0 < float(rows[0][5])  # within one row; the random draw is not


def test_mixes_of_dataframes_compare_by_identity_without_raising():
    import pandas as pd

    frame = pd.DataFrame({"text": ["a", "b"]})
    mix = Mix({"a": frame, "b": "builtin"})
    assert mix == Mix({"a": frame, "b": "builtin"}) and mix != Mix({"a": frame.copy(), "b": "builtin"})
    assert mix != Mix({"a": frame, "b": "builtin"}, {"a": 1, "b": 2}) and hash(mix)
    with pytest.raises(AttributeError, match="Mix is frozen"):
        mix.by = "documents"
