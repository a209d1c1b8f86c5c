"""Sweeps: the warmup-sweep example (a real Hydra multirun of seqmem-train in a subprocess, one job failing on
purpose, then seqmem-report on it); and what works for DDP: a ddp_spawn job inside a multirun, ddp for single runs."""

import csv
import json
import os
import pathlib
import subprocess
import sys

import pytest
from _forked_app import run_forked_main

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"

SHRINK = [
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=2",
    "+trainer.enable_progress_bar=false",
    "+trainer.enable_model_summary=false",
    "data.max_length=64",
    "print_summary=false",
    "~callbacks.preallocate",
]


@pytest.fixture(scope="module")
def warmup_sweep(tmp_path_factory):
    """examples/warmup_sweep.sh, shortened: one real multirun of seqmem-train, then seqmem-report on it, run once for
    the tests below. 12 steps with the preset's validation every 20: only the final validation runs; the training
    loss is recorded every 4 steps."""
    tmp_path = tmp_path_factory.mktemp("warmup_sweep")
    sweep = tmp_path / "sweep"
    env = {
        **os.environ,
        "SWEEP_DIR": str(sweep),
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
    }
    shrink = [o for o in SHRINK if "val_check_interval" not in o and "max_steps" not in o]
    # duration=1.5 is invalid: that job fails at instantiation; the other two must still run and be reported.
    # seed=1 replaces the preset's three seeds: one job per duration.
    cmd = [
        "bash",
        str(EXAMPLES / "warmup_sweep.sh"),
        *shrink,
        "trainer.max_steps=12",
        "trainer.log_every_n_steps=4",  # the preset's 20 would leave 12 steps without a training-loss row
        "data.micro_batch_size=4",
        "callbacks.seq_warmup.duration=0.0,0.5,1.5",
        "seed=1",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    return tmp_path, sweep, proc


@pytest.mark.xdist_group("warmup_sweep")  # one sweep for both: on one worker (--dist loadgroup)
@pytest.mark.slow
def test_warmup_sweep_example_then_report(warmup_sweep, capsys):
    """A failed job does not stop the others; the report lists it, and draws the ones that validated."""
    tmp_path, sweep, proc = warmup_sweep
    assert proc.returncode != 0  # Hydra re-raises the failed job after running all of them; the script keeps it
    assert "duration" in proc.stderr
    assert [json.load(open(sweep / str(i) / "job_status.json"))["status"] for i in range(3)] == [
        "finished",
        "finished",
        "failed",
    ]
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()

    assert "baseline: job 0 (callbacks.seq_warmup.duration=0.0)" in proc.stdout  # the report ran anyway
    assert "Job 2 (callbacks.seq_warmup.duration=1.5) did not finish: failed" in proc.stdout
    with open(sweep / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["status"] for r in rows] == ["finished", "finished", "failed"]
    assert float(rows[0]["speedup_time"]) == 1.0 and float(rows[0]["final_val_loss"]) > 0
    assert int(rows[1]["tokens_seen"]) < int(rows[0]["tokens_seen"])  # warmup trained on shorter sequences
    assert (sweep / "report.png").stat().st_size > 1000 and (sweep / "report.md").exists()
    # What the picture shows: one line per setting that validated, the failed one absent, the target marked.
    from lightning_seqmem.apps.report import build_report, figure, main
    from lightning_seqmem.apps.sweep_jobs import load_jobs

    jobs = load_jobs(str(sweep))
    rep = build_report(jobs)
    fig = figure(jobs, rep)
    for ax in fig.axes[:2]:
        labels = [line.get_label() for line in ax.lines if not line.get_label().startswith("_")]
        assert labels == [
            "callbacks.seq_warmup.duration=0.0",
            "callbacks.seq_warmup.duration=0.5",
            f"target {rep['target']:.4g}",
        ]

    # The report again, with options (the console script itself ran in the example above).
    assert main([str(sweep), "--clock", "cpu", "--target-loss", "100", "--name", "cpu"]) == 0
    assert (sweep / "cpu.csv").exists() and "Times are training CPU time" in capsys.readouterr().out


@pytest.mark.xdist_group("warmup_sweep")  # one sweep for both: on one worker (--dist loadgroup)
@pytest.mark.slow
def test_short_sweep_validates_at_the_last_step_and_reports(warmup_sweep):
    """12 steps with validation scheduled every 20: only the final validation runs, and the report has numbers."""
    _, sweep, _ = warmup_sweep
    for job in ("0", "1"):
        with open(sweep / job / "progress.csv") as f:
            assert [r["step"] for r in csv.DictReader(f)] == ["12"]  # the final validation, and only it
    with open(sweep / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["steps"] for r in rows[:2]] == ["12", "12"] and all(float(r["final_val_loss"]) > 0 for r in rows[:2])
    assert (sweep / "0" / "train_progress.csv").exists() and (sweep / "report.png").stat().st_size > 1000


@pytest.mark.slow
def test_ddp_spawn_job_inside_a_multirun(tmp_path):
    """trainer=ddp_spawn: two CPU processes per job, launched by the Trainer, so the sweep is not re-run per rank;
    the job's data are a ``Mix`` (data=mix), which must pickle into the spawned ranks.

    The multirun is seqmem-train's main() in a process forked from this one (its imports are already paid); the two
    ranks are spawned by the Trainer, fresh interpreters as on a user's machine. The console script itself runs in
    test_ddp_single_run and in the warmup-sweep example."""
    from lightning_seqmem.apps.train import main

    sweep = tmp_path / "sweep"
    argv = [
        "seqmem-train",
        "-m",
        *SHRINK,
        "trainer=ddp_spawn",
        "data=mix",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.precision=32-true",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "callbacks.seq_warmup.duration=0.5",
        f"hydra.sweep.dir={sweep}",
    ]
    proc = run_forked_main(main, argv, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0"]  # one job, not one per rank
    summary = json.load(open(sweep / "0" / "summary.json"))
    assert summary["optimizer_steps"] == 2
    assert summary["slots_fed_to_model"] > 2 * 8 * 16  # both ranks' batches counted
    assert json.load(open(sweep / "0" / "job_status.json")) == {"status": "finished"}
    # The data are a Mix (data=mix): pickled into each spawned rank (a Mix's frozen __setattr__ used to refuse the
    # unpickler there), trained at its shares, each source validated.
    assert abs(summary["source_prose_share"] - 0.7) < 0.01 and abs(summary["source_chat_share"] - 0.3) < 0.01
    assert {"final_val_loss_prose", "final_val_loss_chat"} <= summary.keys()


@pytest.mark.slow
def test_ddp_single_run(tmp_path):
    """trainer=ddp outside a sweep: Lightning re-launches seqmem-train for rank 1 into the same run directory.

    Rank 0 is seqmem-train's main() forked from this process as ``python -m lightning_seqmem.apps.train`` runs it
    (its imports are already paid); Lightning's launcher re-runs that command line for rank 1: a fresh interpreter,
    as on a user's machine."""
    from lightning_seqmem.apps.train import main

    run_dir = tmp_path / "run"
    argv = [
        "seqmem-train",
        *SHRINK,
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.precision=32-true",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        f"hydra.run.dir={run_dir}",
    ]
    proc = run_forked_main(main, argv, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GLOBAL_RANK: 1" in proc.stdout + proc.stderr  # rank 1 ran, in a process Lightning launched
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["optimizer_steps"] == 2 and summary["slots_fed_to_model"] > 2 * 8 * 16
    assert json.load(open(run_dir / "job_status.json")) == {"status": "finished"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # rank 1 wrote nowhere else
