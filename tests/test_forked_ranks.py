"""``_forked_ranks.run_ranks``, the multi-process tests' launcher: ranks join one Gloo group from the environment and
their results come back by rank; a rank that fails or dies, or a run past its time, fails the test at once with the
rank's traceback, and no rank is left waiting at a collective."""

import os
import time

import pytest
import torch
import torch.distributed as dist
from _forked_ranks import run_ranks


def _sum_of_ranks(rank, offset):
    dist.init_process_group("gloo")
    total = torch.tensor([rank + offset])
    dist.all_reduce(total)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "total": total, "threads": torch.get_num_threads()}


def test_ranks_join_one_group_and_return_by_rank():
    got = run_ranks(_sum_of_ranks, 10, world=3)
    assert [r["rank"] for r in got] == [0, 1, 2] and {r["world"] for r in got} == {3}
    assert all(torch.equal(r["total"], torch.tensor([33])) for r in got) and {r["threads"] for r in got} == {1}
    assert not dist.is_initialized() and "LOCAL_RANK" not in os.environ  # nothing leaks into the test process


def _rank_one_fails(rank, how):
    dist.init_process_group("gloo")
    if rank == 1 and how == "raise":
        raise ValueError("rank one's own error")
    if rank == 1:
        os._exit(3)
    dist.barrier()  # rank 0 waits for a rank that is gone


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_failing_rank_fails_the_run_at_once_with_its_traceback(how):
    start = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_ranks(_rank_one_fails, how, timeout=60)
    assert time.monotonic() - start < 30  # not the time limit, nor Gloo's 30 minutes
    expected = "ValueError: rank one's own error" if how == "raise" else "died (exit code 3) without a report"
    assert "rank 1 failed:" in str(failed.value) and expected in str(failed.value)


def _sleep(rank):
    time.sleep(60)


def test_ranks_past_the_time_limit_are_killed():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[0, 1\] killed still running after 0.5 s"):
        run_ranks(_sleep, timeout=0.5)
    assert time.monotonic() - start < 10
