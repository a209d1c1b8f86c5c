"""Samplers: equal batch counts per rank, no index lost or repeated, epoch reshuffles, budgets, exact resume."""

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_seqmem.batching.batch_list import balanced_batch_sizes
from lightning_seqmem.batching.collate import PadCollator
from lightning_seqmem.batching.sampling import (
    BatchFetcher,
    LengthGroupedSampler,
    ShuffledBatchSampler,
    TokenBudgetBatchSampler,
)


def _pad8(n):
    return -(-n // 8) * 8


def _all_ranks(make, world):
    return [make(num_replicas=world, rank=r).batches() for r in range(world)]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 300), batch_size=st.integers(1, 16), world=st.integers(1, 4), drop_last=st.booleans())
def test_balanced_batch_sizes(n, batch_size, world, drop_last):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sizes = balanced_batch_sizes(n, batch_size, world, drop_last)
    assert len(sizes) % world == 0 and all(1 <= s <= batch_size for s in sizes)
    if drop_last:
        assert n - sum(sizes) < batch_size * world
    else:
        assert n - sum(sizes) < world  # only when there are too few items to give every rank a batch
        assert bool(caught) == (n != sum(sizes))  # and then a warning says so


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 200), min_size=8, max_size=120),
    world=st.integers(1, 3),
    kind=st.sampled_from(["shuffled", "grouped", "budget"]),
    epoch=st.integers(0, 3),
)
def test_every_rank_gets_the_same_number_of_batches_and_no_index_is_lost(lengths, world, kind, epoch):
    makers = {
        "shuffled": lambda **kw: ShuffledBatchSampler(len(lengths), 4, seed=3, **kw),
        "grouped": lambda **kw: LengthGroupedSampler(lengths, 4, mega_batch_mult=2, seed=3, **kw),
        "budget": lambda **kw: TokenBudgetBatchSampler(lengths, 512, padded_length=_pad8, seed=3, **kw),
    }
    samplers = [makers[kind](num_replicas=world, rank=r) for r in range(world)]
    for s in samplers:
        s.set_epoch(epoch)
    per_rank = [list(s) for s in samplers]
    assert len({len(b) for b in per_rank}) == 1 and all(len(s) == len(per_rank[0]) for s in samplers)
    seen = sorted(i for batches in per_rank for b in batches for i in b)
    assert seen == list(range(len(lengths)))
    if kind == "budget":
        assert all(len(b) * _pad8(max(lengths[i] for i in b)) <= 512 for bs in per_rank for b in bs)


def test_epochs_reshuffle_deterministically():
    s = ShuffledBatchSampler(100, 8, seed=1)
    assert s.batches(0) != s.batches(1)
    assert s.batches(1) == ShuffledBatchSampler(100, 8, seed=1).batches(1)
    assert ShuffledBatchSampler(100, 8, seed=2).batches(1) != s.batches(1)


def test_length_grouping_cuts_padding_and_puts_the_longest_batch_first():
    lengths = np.random.default_rng(0).integers(1, 500, 1000)

    def padded_slots(batches):
        return sum(len(b) * lengths[b].max() for b in batches)

    grouped = LengthGroupedSampler(lengths, 8, seed=0).batches()
    plain = ShuffledBatchSampler(len(lengths), 8, seed=0).batches()
    assert padded_slots(grouped) < 0.7 * padded_slots(plain)
    assert lengths[grouped[0]].max() == lengths.max()


def test_token_budget_smaller_than_one_row_is_an_error():
    with pytest.raises(ValueError, match="max_tokens_per_batch=100 is smaller than one row.*>= 104"):
        TokenBudgetBatchSampler([10, 100], 100, padded_length=_pad8)


def test_drop_last_is_counted():
    s = ShuffledBatchSampler(10, 4, drop_last=True)
    assert [len(b) for b in s] == [4, 4] and s.num_dropped == 2


@pytest.mark.parametrize("kind", ["shuffled", "grouped", "budget"])
def test_resume_mid_epoch_yields_exactly_the_remaining_batches(kind):
    lengths = np.random.default_rng(0).integers(1, 60, 50)
    make = {
        "shuffled": lambda: ShuffledBatchSampler(50, 4, seed=5),
        "grouped": lambda: LengthGroupedSampler(lengths, 4, mega_batch_mult=2, seed=5),
        "budget": lambda: TokenBudgetBatchSampler(lengths, 128, seed=5),
    }[kind]
    first = make()
    first.set_epoch(2)
    it = iter(first)
    head = [next(it) for _ in range(3)]
    state = first.state_dict()
    rest = list(it)
    resumed = make()
    resumed.load_state_dict(state)
    assert list(resumed) == rest and head + rest == make().batches(2)
    resumed.set_epoch(3)
    assert list(resumed) == make().batches(3)  # the next epoch starts from its beginning


def test_stateful_dataloader_resume():
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = [{"input_ids": list(range(1, 2 + i % 9))} for i in range(40)]

    def loader():
        return StatefulDataLoader(
            BatchFetcher(data), sampler=ShuffledBatchSampler(40, 4, seed=1), batch_size=None, collate_fn=PadCollator(0)
        )

    dl = loader()
    it = iter(dl)
    [next(it) for _ in range(4)]
    state = dl.state_dict()
    rest = [b["input_ids"].tolist() for b in it]
    dl2 = loader()
    dl2.load_state_dict(state)
    assert [b["input_ids"].tolist() for b in dl2] == rest and len(rest) == 6


# ------------------------------------------------------------------ batches as index spans (BatchList)
def test_batch_list_reduces_each_batch_like_a_loop_over_lists():
    from lightning_seqmem.batching.batch_list import BatchList

    rng = np.random.default_rng(0)
    values = rng.integers(0, 1000, 500)
    batches = BatchList.cut(rng.permutation(500), rng.multinomial(500, np.ones(60) / 60) + 0)
    batches = batches.take(np.flatnonzero(batches.sizes > 0))
    picked = batches.take(rng.permutation(len(batches))[: len(batches) // 2])  # any order, with gaps
    as_lists = list(picked)
    assert picked.reduce(values, np.maximum).tolist() == [int(values[b].max()) for b in as_lists]
    assert picked.reduce(values, np.add).tolist() == [int(values[b].sum()) for b in as_lists]
    assert picked.sizes.tolist() == [len(b) for b in as_lists]
    assert picked[1:3] == as_lists[1:3] and picked[2] == as_lists[2]


@pytest.mark.parametrize("kind", ["shuffled", "grouped", "budget"])
@pytest.mark.parametrize("replicas,drop_last", [(1, False), (3, False), (2, True)])
def test_each_rank_gets_its_stride_of_the_global_batches_costliest_first(kind, replicas, drop_last):
    rng = np.random.default_rng(replicas)
    lengths = rng.integers(1, 300, 257)

    def make(rank):
        common = dict(seed=5, num_replicas=replicas, rank=rank, drop_last=drop_last)
        if kind == "shuffled":
            return ShuffledBatchSampler(len(lengths), 6, **common)
        if kind == "grouped":
            return LengthGroupedSampler(lengths, 6, mega_batch_mult=3, **common)
        return TokenBudgetBatchSampler(lengths, 1024, padded_length=lambda n: -(-n // 8) * 8, **common)

    seen = []
    for rank in range(replicas):
        s = make(rank)
        for epoch in (0, 1):
            everyone = list(s.global_batches(epoch))
            stride = everyone[rank::replicas]
            cost = [s.batch_cost(b) for b in stride]
            top = cost.index(max(cost))
            stride[0], stride[top] = stride[top], stride[0]
            assert list(s.batches(epoch)) == stride
        if kind == "grouped":
            assert s.batch_cost(stride[1]) == float(lengths[stride[1]].max()) * len(stride[1])
        if kind == "budget":
            assert s.batch_cost(stride[1]) == float(-(-lengths[stride[1]].max() // 8) * 8) * len(stride[1])
        s.set_epoch(0)
        seen += [i for b in s for i in b]
    assert len(seen) == len(set(seen)) == len(lengths) - make(0).num_dropped
