"""Issue 17's properties on a real GPU (skipped without CUDA): the checks ``benchmarks/gpu.py`` prints, asserted.

Each check runs in a fresh process through the benchmark's own code (``run_child``), at the benchmark's full
sizes: the allocator reads its settings once per process, and its statistics must start clean.
"""

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (benchmarks/gpu.py --smoke on CPU)")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
import gpu as bench  # noqa: E402


@pytest.mark.parametrize("strategy", ["pad", "pack"])
@pytest.mark.parametrize("expandable", [False, True], ids=["cached", "expandable"])
def test_preallocation_reserves_the_steady_state_peak(strategy, expandable):
    r = bench.run_child(False, "prealloc", f"{strategy} {expandable}", strategy, True, expandable, False)
    assert "error" not in r, r
    assert r["growth"] <= 0.01 * r["peak"], r
    assert r["retries"] == 0, r
    assert r["monitor"]["steps"] == 60 and "reserved_growth_gib" in r["monitor"]  # step 60 is not a logging step


def test_planner_estimate_within_five_percent_of_max_memory_allocated():
    cases = bench.run_child(False, "planner")
    assert isinstance(cases, list) and len(cases) == 9, cases
    for case in cases:
        assert abs(case["estimate"] - case["measured"]) <= 0.05 * case["measured"], case


def test_packed_documents_stay_apart_per_attention_and_dtype():
    cases = bench.run_child(False, "contamination")
    assert isinstance(cases, list) and len(cases) == 4, cases
    for case in cases:
        tolerance = 1e-4 if case["dtype"] == "float32" else 5e-2
        assert case["clean"] <= tolerance < case["contaminated"], case


def test_fsdp_trains_with_norm_clipping_and_preallocation():
    r = bench.run_child(False, "fsdp")
    assert "error" not in r, r
    assert r["steps"] == 10 and r["loss"] == r["loss"] and r["passes"], r


def test_monitor_finishes_when_the_last_step_is_not_a_logging_step(tmp_path):
    import lightning.pytorch as L
    from _memory_helpers import TinyData, TinyLM

    from lightning_seqmem.memory import MemoryMonitor

    monitor = MemoryMonitor(every_n_steps=5)
    L.Trainer(
        max_steps=7,
        accelerator="cuda",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        callbacks=[monitor],
    ).fit(TinyLM(), datamodule=TinyData())
    assert [row["step"] for row in monitor.history] == [1, 5, 7]
    assert monitor.summary["steps"] == 7 and "reserved_growth_gib" in monitor.summary
