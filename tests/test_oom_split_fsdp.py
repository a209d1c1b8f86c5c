"""``on_oom="split"`` under FSDP: one rank runs out of memory, the others never wait in a collective.

Two forked gloo ranks (``_forked_ranks``) under ``CPUFSDPStrategy`` (Lightning's ``FSDPStrategy``, FSDP1), each decoder
layer its own FSDP unit, ``SHARD_GRAD_OP``, two accumulated micro-batches per step; the out-of-memory error is
injected on one rank only (:class:`OomInjector`), in the forward or in the backward of a decoder layer. The weights
after training (gathered) must be the ones FSDP's own run (``on_oom="raise"``, nothing injected) reaches.
"""

import collections
import functools

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from _forked_ranks import run_ranks
from _memory_cpu_fsdp import CPUFSDPStrategy
from test_oom_split import TINY, VOCAB, _pairs, padded, worst_relative
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.utils.data import DataLoader
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from lightning_seqmem import DPO, CausalLM
from lightning_seqmem.memory.preallocate import CachePreallocator
from lightning_seqmem.oom.split import OomInjector

TOL = 1e-6
PER_RANK = {r: [padded(rows=4, seed=10 * r + i) for i in range(4)] for r in range(2)}


# All-reduces the split path adds to FSDP's own over the 4 micro-batches (2 windows) of these runs: the agreement
# after each micro-batch (4), the room for FSDP's gather agreed at each window's first (2), the room for its
# reduction and the optimizer step agreed at each window's last (2 x 2): the allocations around the collectives.
SPLIT_ALL_REDUCES = 4 + 2 + 4
COLLECTIVES = ("all_gather", "all_gather_single", "reduce_scatter_single", "reduce_scatter_tensor", "all_reduce")


def count_collectives() -> collections.Counter:
    """Count this (forked) rank's calls of the collectives FSDP and the agreement make, by name."""
    counts = collections.Counter()
    for name in COLLECTIVES:
        call = getattr(dist, name)

        def counted(*args, _call=call, _name=name, **kwargs):
            counts[_name] += 1
            return _call(*args, **kwargs)

        setattr(dist, name, counted)
    return counts


class RankBatches(CausalLM):
    """Each rank reads its own micro-batches."""

    def train_dataloader(self):
        return DataLoader(PER_RANK[self.global_rank], batch_size=None)


def _fit_rank(
    rank, on_oom, inject_rank, max_tokens, where="forward", batches=None, sharding="SHARD_GRAD_OP", callbacks=()
):
    counts = count_collectives()
    torch.manual_seed(0)
    model = RankBatches(model_config=TINY, vocab_size=VOCAB, pad_token_id=0, on_oom=on_oom)
    if batches is not None:
        PER_RANK[rank] = batches[rank]
    if rank == inject_rank:
        OomInjector(max_tokens, where=where).install(model.model.model.layers[0])
    strategy = CPUFSDPStrategy(
        auto_wrap_policy={LlamaDecoderLayer}, sharding_strategy=sharding, process_group_backend="gloo"
    )
    trainer = L.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_epochs=1,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[callback() for callback in callbacks],
    )
    trainer.fit(model)
    assert trainer.global_step == 2
    trained = dict(counts)
    with FullyShardedDataParallel.summon_full_params(trainer.strategy.model, writeback=False):
        weights = {n: p.detach().clone() for n, p in model.model.named_parameters()}
    return weights, model.oom_splits, model.oom_split_tokens, trained


@pytest.fixture(scope="module")
def reference():
    """FSDP's own run: ``on_oom="raise"``, nothing injected (a reduce-scatter per micro-batch)."""
    return run_ranks(_fit_rank, "raise", None, 0)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_one_rank_out_of_memory_trains_to_the_weights_of_fsdp(reference, where):
    (w0, splits0, limit0, counts0), (w1, splits1, limit1, counts1) = run_ranks(_fit_rank, "split", 1, 40, where)
    assert splits0 == 0 and splits1 >= 2  # only rank 1 failed ...
    assert limit0 == limit1 == 48  # ... and both split its size from then on
    assert worst_relative(w0, w1) == 0.0  # one reduced gradient: the ranks hold the same weights
    assert worst_relative(w0, reference[0][0]) <= TOL
    # FSDP's gathers and reduce-scatters as many as in its own run (once per window, none inside the parts, the
    # failed ones included); one all-reduce more per micro-batch (the agreement), on both ranks alike.
    for counts, (*_, fsdp) in zip((counts0, counts1), reference):
        fsdp = dict(fsdp)
        assert counts.pop("all_reduce") == fsdp.pop("all_reduce") + SPLIT_ALL_REDUCES
        assert counts == fsdp and fsdp["reduce_scatter_single"] > 0


@pytest.mark.slow
def test_cache_preallocator_trial_step_runs_unsplit_under_fsdp(reference):
    """CachePreallocator's trial step goes through FSDP's wrapped module: with splitting paused it is Lightning's
    step (its own backward), and the run trains as FSDP's."""
    trial = functools.partial(CachePreallocator, rows=4, length=24)
    (w0, splits0, _, _), (w1, _, _, _) = run_ranks(
        _fit_rank, "split", None, 0, "forward", None, "SHARD_GRAD_OP", [trial]
    )
    assert splits0 == 0 and worst_relative(w0, w1) == 0.0
    assert worst_relative(w0, reference[0][0]) <= TOL


# A window whose first micro-batch fits and whose second does not: the failure meets gradients already held.
GROWING = {r: [padded(rows=rows, seed=10 * r + i) for i, rows in enumerate((2, 4, 2, 4))] for r in range(2)}


@pytest.fixture(scope="module")
def reference_growing():
    return run_ranks(_fit_rank, "raise", None, 0, "forward", GROWING)[0][0]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_failure_after_the_windows_first_micro_batch_keeps_its_gradient(reference_growing, where):
    reference = reference_growing
    (w0, splits0, limit0, _), (w1, splits1, limit1, _) = run_ranks(_fit_rank, "split", 1, 50, where, GROWING)
    assert (splits0, splits1, limit0) == (0, 1, 96)
    assert worst_relative(w0, w1) == 0.0 and worst_relative(w0, reference) <= TOL


class WithValidation(RankBatches):
    """Micro-batches of 48 tokens that fit; a validation batch of 96 that does not (on the injected rank)."""

    def train_dataloader(self):
        return DataLoader([padded(rows=2, seed=10 * self.global_rank + i) for i in range(4)], batch_size=None)

    def val_dataloader(self):
        return DataLoader([padded(rows=4, seed=50 + self.global_rank)], batch_size=None)

    def on_validation_epoch_end(self):
        super().on_validation_epoch_end()
        VAL_LOSSES.append(float(self.trainer.callback_metrics["val/loss"]))  # the sanity check's, then the epoch's


VAL_LOSSES = []


def _fit_with_validation(rank, on_oom, inject_rank):
    global RankBatches
    plain, RankBatches = RankBatches, WithValidation
    try:
        weights, splits, _, _ = _fit_rank(rank, on_oom, inject_rank, 50)
    finally:
        RankBatches = plain
    return weights, splits, VAL_LOSSES


@pytest.mark.slow
def test_a_validation_batch_out_of_memory_on_one_rank_is_split_too():
    """Evaluation steps run inside FSDP's root forward: split there as well, no rank left waiting."""
    (ref, _, ref_losses), _ = run_ranks(_fit_with_validation, "raise", None)
    (w0, splits0, losses), (w1, splits1, _) = run_ranks(_fit_with_validation, "split", 1)
    assert splits0 == 0 and splits1 >= 1  # the validation batch, on rank 1 only
    assert len(losses) == len(ref_losses) == 2 and losses == pytest.approx(ref_losses, rel=1e-6)
    assert worst_relative(w0, w1) == 0.0 and worst_relative(w0, ref) <= TOL


class ValidationRowTooLarge(WithValidation):
    """Rank 1's validation row (24 tokens, one document) runs out of memory at its second decoder layer."""

    def val_dataloader(self):
        return DataLoader([padded(rows=1, seed=50 + self.global_rank)], batch_size=None)

    def on_validation_start(self):
        if self.global_rank == 1:
            OomInjector(10).install(self.model.model.layers[1])


def _validate_too_large(rank):
    global RankBatches
    plain, RankBatches = RankBatches, ValidationRowTooLarge
    try:
        return _fit_rank(rank, "split", None, 0)
    finally:
        RankBatches = plain


@pytest.mark.slow
def test_a_validation_row_that_fits_nowhere_stops_every_rank():
    """The units are gathered before the parts: rank 0 is not left in the gather of a unit rank 1 never reaches."""
    with pytest.raises(AssertionError) as failed:
        run_ranks(_validate_too_large, timeout=60)
    text = str(failed.value)
    assert "killed" not in text
    assert "rank 1: validation step 0: a single row of 24 tokens" in text
    assert "a single row on another rank ran out of memory" in text


@pytest.mark.slow
def test_a_row_that_fits_nowhere_stops_every_rank_under_fsdp():
    batches = {0: [padded(rows=1, seed=1)] * 2, 1: [padded(rows=4, seed=2)] * 2}
    with pytest.raises(AssertionError) as failed:
        run_ranks(_fit_rank, "split", 0, 10, "forward", batches, timeout=60)
    text = str(failed.value)
    assert "killed" not in text  # both ranks stopped by themselves
    assert "rank 0: train step 0: a single row of 24 tokens" in text
    assert "a single row on another rank ran out of memory" in text


@pytest.mark.parametrize(
    ("sharding", "why"),
    [("FULL_SHARD", "FULL_SHARD gathers them again inside the backward"), ("NO_SHARD", "use strategy='ddp'")],
)
def test_other_shardings_are_refused_with_the_one_that_works(sharding, why):
    with pytest.raises(AssertionError) as failed:
        run_ranks(_fit_rank, "split", None, 0, "forward", None, sharding, timeout=60)
    assert "killed" not in str(failed.value)  # refused at setup, on both ranks
    assert why in str(failed.value) and "Use FSDPStrategy(sharding_strategy='SHARD_GRAD_OP')" in str(failed.value)


PAIRS = {r: [_pairs(False, seed=10 * r + i) for i in range(4)] for r in range(2)}  # 3 pairs, 6 rows of 16


class RankPairs(DPO):
    """``DPO`` with its frozen reference copy (FSDP units of its own, gathered with the policy's)."""

    def __init__(self, **kwargs):
        super().__init__(cross_entropy="full", **kwargs)

    def train_dataloader(self):
        return DataLoader(PAIRS[self.global_rank], batch_size=None)


def _fit_pairs(rank, on_oom, inject_rank, max_tokens, batches=None):
    global RankBatches, PAIRS
    plain, RankBatches = RankBatches, RankPairs
    if batches is not None:
        PAIRS = batches
    try:
        return _fit_rank(rank, on_oom, inject_rank, max_tokens)
    finally:
        RankBatches = plain


@pytest.mark.slow
def test_dpo_pairs_under_fsdp_train_to_the_weights_of_fsdp():
    (reference, *_, fsdp), _ = run_ranks(_fit_pairs, "raise", None, 0)
    (w0, splits0, _, counts), (w1, splits1, _, _) = run_ranks(_fit_pairs, "split", 1, 60)
    assert splits0 == 0 and splits1 >= 1
    assert worst_relative(w0, w1) == 0.0 and worst_relative(w0, reference) <= TOL
    assert counts.pop("all_reduce") == fsdp.pop("all_reduce") + SPLIT_ALL_REDUCES and counts == fsdp


@pytest.mark.slow
def test_a_pair_that_fits_nowhere_stops_every_rank_under_fsdp():
    """Rank 0's single pair does not fit: the reference copy's units were gathered before, no rank waits in one."""
    one_pair = {k: v[[0, 3]] for k, v in _pairs(False, seed=1).items()}
    batches = {0: [one_pair] * 2, 1: PAIRS[1][:2]}
    with pytest.raises(AssertionError) as failed:
        run_ranks(_fit_pairs, "split", 0, 10, batches, timeout=60)
    text = str(failed.value)
    assert "killed" not in text
    assert "rank 0: train step 0: a single row of 32 tokens" in text
    assert "a single row on another rank ran out of memory" in text
