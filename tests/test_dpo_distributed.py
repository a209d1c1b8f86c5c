"""DPO under Lightning's DDP and FSDP on two forked CPU ranks (gloo), packed pairs, norm clipping and
pre-allocation: the frozen reference copy stays out of the optimizer and unchanged, and FSDP trains to DDP's losses
and weights."""

import pytest
import torch
from _dpo_dist_script import main
from _forked_ranks import run_ranks


@pytest.mark.slow
def test_dpo_under_fsdp_trains_as_under_ddp_with_a_frozen_reference():
    ddp, fsdp = run_ranks(main, "ddp")[0], run_ranks(main, "fsdp")[0]
    assert len(ddp["losses"]) == 3  # the pre-allocation pass, then two steps
    assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-5)
    assert ddp["state"].keys() == fsdp["state"].keys()
    for name, value in ddp["state"].items():
        torch.testing.assert_close(fsdp["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    for run in (ddp, fsdp):
        moved = False
        for name, initial in run["initial"].items():
            assert torch.equal(run["state"][f"reference_model.{name}"], initial), name  # the copy never trains
            moved |= not torch.equal(run["state"][f"model.{name}"], initial)
        assert moved  # the policy did


def _validate_on_a_rank(rank, cache):
    """One of two DDP ranks: DPO fitted two steps on a two-source preference ``Mix`` (8 validation pairs each), then
    the validation metrics this rank holds, and ``test/loss`` of one source's test split."""
    import datasets
    import lightning.pytorch as pl
    from test_preference_datamodule import TINY, module, splits, text_rows

    from lightning_seqmem import DPO, Mix

    rows = text_rows(48)
    loud = [dict(r, chosen=r["chosen"].upper()) for r in rows]
    dm = module(Mix({"plain": splits(rows), "loud": splits(loud)}, {"plain": 0.7, "loud": 0.3}), cache)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=2,
        val_check_interval=2,
        num_sanity_val_steps=0,
    )
    model = DPO(model_config=TINY)
    trainer.fit(model, datamodule=dm)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    # the trained model on one source's test split (untrained, every pair's loss would be log 2 on either rank)
    tested = module(datasets.DatasetDict(train=splits(rows)["train"], test=splits(rows)["validation"]), cache)
    tester = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_progress_bar=False)
    return metrics | tester.test(model, datamodule=tested, verbose=False)[0]


@pytest.mark.slow
def test_dpo_validation_metrics_are_every_ranks_pairs(tmp_path):
    """Under DDP, ``val/loss`` is the mean over both ranks' validation pairs, the same on each rank (it was each
    rank's own half), and the pair-weighted mean of the sources' ``val/loss/<name>`` (equal pairs here); the reward
    metrics and ``test/loss`` are every rank's too."""
    import datasets
    from test_preference_datamodule import module, splits, text_rows

    from lightning_seqmem import Mix

    rows = text_rows(48)
    loud = [dict(r, chosen=r["chosen"].upper()) for r in rows]
    module(Mix({"plain": splits(rows), "loud": splits(loud)}, {"plain": 0.7, "loud": 0.3}), tmp_path)  # cache once
    module(datasets.DatasetDict(train=splits(rows)["train"], test=splits(rows)["validation"]), tmp_path)
    first, second = run_ranks(_validate_on_a_rank, tmp_path, timeout=300)
    assert first == pytest.approx(second) and "test/loss" in first
    assert first["val/loss"] == pytest.approx((first["val/loss/plain"] + first["val/loss/loud"]) / 2, rel=1e-5)
