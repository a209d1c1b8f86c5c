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
