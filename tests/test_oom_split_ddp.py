"""``on_oom="split"`` under DDP: one rank runs out of memory, the ranks agree, none waits in a collective.

Two forked gloo ranks (``_forked_ranks``), Lightning's ``strategy="ddp"``, two accumulated micro-batches per step;
the out-of-memory error is injected on one rank only (:class:`OomInjector` on its Hugging Face model). The weights
after training must be the ones DDP's own run (``on_oom="raise"``, nothing injected) reaches, on both ranks.
"""

import lightning.pytorch as L
import pytest
import torch
from _forked_ranks import run_ranks
from test_oom_split import TINY, VOCAB, padded, worst_relative
from torch.utils.data import DataLoader

from lightning_seqmem import CausalLM
from lightning_seqmem.oom.split import OomInjector

TOL = 1e-6
PER_RANK = {r: [padded(rows=4, seed=10 * r + i) for i in range(4)] for r in range(2)}


class RankBatches(CausalLM):
    """Each rank reads its own micro-batches."""

    def train_dataloader(self):
        return DataLoader(PER_RANK[self.global_rank], batch_size=None)


def _fit_rank(rank, on_oom, inject_rank, max_tokens, batches=None):
    torch.manual_seed(0)
    model = RankBatches(model_config=TINY, vocab_size=VOCAB, pad_token_id=0, on_oom=on_oom)
    if batches is not None:
        PER_RANK[rank] = batches[rank]
    if rank == inject_rank:
        OomInjector(max_tokens).install(model.model)
    trainer = L.Trainer(
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        max_epochs=1,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model)
    assert trainer.global_step == 2
    weights = {n: p.detach().clone() for n, p in model.model.named_parameters()}
    return weights, model.oom_splits, model._oom.limit if model._oom is not None else None


@pytest.mark.slow
def test_one_rank_out_of_memory_trains_to_the_weights_of_ddp():
    reference = run_ranks(_fit_rank, "raise", None, 0)
    split = run_ranks(_fit_rank, "split", 1, 40)
    (w0, splits0, limit0), (w1, splits1, limit1) = split
    assert splits0 == 0 and splits1 >= 2  # only rank 1 failed ...
    assert limit0 == limit1 == 48  # ... and both split its size from then on
    assert worst_relative(w0, w1) == 0.0  # one reduced gradient: the ranks stay identical
    assert worst_relative(w0, reference[0][0]) <= TOL


@pytest.mark.slow
def test_a_row_that_fits_nowhere_stops_every_rank():
    """Rank 0's single row does not fit: it raises the full error, rank 1 raises too (no hang in a collective)."""
    batches = {0: [padded(rows=1, seed=1)] * 2, 1: [padded(rows=4, seed=2)] * 2}
    with pytest.raises(AssertionError) as failed:
        run_ranks(_fit_rank, "split", 0, 10, batches, timeout=60)
    text = str(failed.value)
    assert "killed" not in text  # both ranks stopped by themselves
    assert "rank 0: train step 0: a single row of 24 tokens" in text
    assert "a single row on another rank ran out of memory" in text
