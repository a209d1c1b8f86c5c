"""A mixture sweep as users run it: ``seqmem-train -m data=mix data.weights.chat=...``, then ``seqmem-report``
showing each source's validation loss per job."""

import csv
import json

import pytest
from _forked_app import run_forked_main
from _job_imports import import_job_modules
from test_sweep import SHRINK


@pytest.mark.slow
def test_weight_sweep_reports_each_sources_validation_loss_per_job(tmp_path):
    from lightning_seqmem.apps.report import main as report
    from lightning_seqmem.apps.train import main

    import_job_modules()  # imported here once, not in the forked job
    sweep = tmp_path / "sweep"
    argv = ["seqmem-train", "-m", "data=mix", "data.weights.chat=0.1,0.9", *SHRINK, f"hydra.sweep.dir={sweep}"]
    proc = run_forked_main(main, argv, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for job in ("0", "1"):
        with open(sweep / job / "val_sources.csv") as f:
            assert {r["source"] for r in csv.DictReader(f)} == {"prose", "chat"}
        assert json.load(open(sweep / job / "job_status.json")) == {"status": "finished"}
    assert report([str(sweep)]) == 0
    with open(sweep / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["overrides"] for r in rows] == ["data.weights.chat=0.1", "data.weights.chat=0.9"]
    for r in rows:
        assert float(r["final_val_loss/prose"]) > 0 and float(r["final_val_loss/chat"]) > 0
    # more of a source in training, lower its validation loss relative to the other's
    gap = [float(r["final_val_loss/chat"]) - float(r["final_val_loss/prose"]) for r in rows]
    assert gap[1] < gap[0]
    text = (sweep / "report.md").read_text()
    assert "Final validation loss per source" in text and "| chat | prose |" in text
