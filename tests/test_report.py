"""seqmem-report on hand-made sweep folders: numbers, baseline and target choice, failed jobs, bad input."""

import csv
import json

import numpy as np
import pytest

from lightning_seqmem.apps import report
from lightning_seqmem.apps.sweep_jobs import load_jobs


def make_job(root, name, overrides, rows, status="finished", error=None):
    """A job folder as seqmem-train writes it: .hydra/overrides.yaml, progress.csv, job_status.json."""
    job = root / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if rows is not None:
        with open(job / "progress.csv", "w", newline="") as f:
            writer = csv.DictWriter(
                f, fieldnames=["step", "wall_clock_s", "elapsed_s", "cpu_s", "tokens_seen", "val_loss"]
            )
            writer.writeheader()
            for step, t, tokens, loss in rows:
                writer.writerow(
                    {
                        "step": step,
                        "wall_clock_s": t,
                        "elapsed_s": t + 1,
                        "cpu_s": 2 * t,
                        "tokens_seen": tokens,
                        "val_loss": loss,
                    }
                )
    if status is not None:
        record = {"status": status, **({"error": error} if error else {})}
        (job / "job_status.json").write_text(json.dumps(record))
    return job


@pytest.fixture()
def sweep(tmp_path):
    common = "trainer.max_steps=30"
    # Baseline ends at 4.0 after 30 s / 3000 tokens; warmup reaches 4.0 half-way between its points at 10 s and 20 s.
    make_job(
        tmp_path,
        "0",
        ["callbacks.seq_warmup.duration=0.0", common],
        [(10, 10.0, 1000, 6.0), (20, 20.0, 2000, 5.0), (30, 30.0, 3000, 4.0)],
    )
    make_job(
        tmp_path,
        "1",
        ["callbacks.seq_warmup.duration=0.3", common],
        [(10, 10.0, 500, 5.0), (20, 20.0, 1500, 3.0), (30, 30.0, 2500, 2.5)],
    )
    make_job(
        tmp_path,
        "2",
        ["callbacks.seq_warmup.duration=0.6", common],
        [(10, 8.0, 400, 7.0)],
        status="failed",
        error="RuntimeError: boom",
    )
    return tmp_path


def test_reach_interpolates():
    rows = [{"val_loss": 4.0, "t": 10.0}, {"val_loss": 2.0, "t": 20.0}]
    assert report.reach(rows, 3.0, "t") == 15.0
    assert report.reach(rows, 4.5, "t") == 10.0  # already below at the first point
    assert report.reach(rows, 1.0, "t") is None


def test_report_table_and_files(sweep, capsys):
    assert report.main([str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "Target val loss: **4.0000**" in out and "baseline: job 0" in out
    with open(sweep / "report.csv") as f:
        rows = {r["job"]: r for r in csv.DictReader(f)}
    assert float(rows["0"]["time_to_target_s"]) == 30.0 and float(rows["0"]["speedup_time"]) == 1.0
    assert float(rows["1"]["time_to_target_s"]) == 15.0  # 5.0 -> 3.0 between 10 s and 20 s
    assert float(rows["1"]["speedup_time"]) == 2.0
    assert float(rows["1"]["tokens_to_target"]) == 1000.0 and float(rows["1"]["speedup_tokens"]) == 3.0
    assert rows["2"]["status"] == "failed" and rows["2"]["time_to_target_s"] == ""
    md = (sweep / "report.md").read_text()
    assert "| 1 | callbacks.seq_warmup.duration=0.3 | finished |" in md
    assert "Job 2 (callbacks.seq_warmup.duration=0.6) did not finish: failed — RuntimeError: boom" in md
    assert "Every job: trainer.max_steps=30" in md
    assert (sweep / "report.png").stat().st_size > 1000


def test_target_baseline_and_clock_options(sweep, tmp_path):
    out = tmp_path / "out"
    rep = report.write_report(
        str(sweep), str(out), target_loss=5.0, baseline="callbacks.seq_warmup.duration=0.3", clock="cpu"
    )
    rows = {r["job"]: r for r in rep["rows"]}
    assert rep["baseline"].name == "1" and rep["target"] == 5.0
    assert rows["1"]["time_to_target_s"] == 20.0  # cpu_s = 2 * wall in the fixture
    assert rows["0"]["time_to_target_s"] == 40.0 and rows["0"]["speedup_time"] == 0.5
    assert (out / "report.md").exists() and (out / "report.csv").exists()


def test_any_parameter_first_job_is_baseline(tmp_path):
    make_job(tmp_path, "0", ["batching=pad"], [(10, 20.0, 1000, 5.0)])
    make_job(tmp_path, "1", ["batching=pack_bfd"], [(10, 10.0, 2000, 5.0)])
    rep = report.write_report(str(tmp_path))
    assert rep["baseline"].name == "0"
    assert [r["overrides"] for r in rep["rows"]] == ["batching=pad", "batching=pack_bfd"]
    assert rep["rows"][1]["speedup_time"] == 2.0


def test_killed_job_without_status_is_listed(tmp_path):
    make_job(tmp_path, "0", ["model.learning_rate=1e-3"], [(10, 10.0, 100, 5.0)])
    make_job(tmp_path, "1", ["model.learning_rate=2e-3"], [(10, 10.0, 100, 4.0)], status="running")
    rep = report.write_report(str(tmp_path))
    assert rep["rows"][1]["status"] == "did not finish"
    assert any("Job 1" in note and "1 validation point(s) kept" in note for note in rep["notes"])


def test_empty_dir_is_a_clear_error(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    assert "No jobs in" in capsys.readouterr().err
    assert report.main([str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_jobs_without_metrics_are_a_clear_error(tmp_path, capsys):
    make_job(tmp_path, "0", ["a=1"], None, status="failed", error="ValueError: bad")
    make_job(tmp_path, "1", ["a=2"], None, status=None)
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "None of the 2 jobs recorded metrics" in err and "0 (failed)" in err and "1 (did not finish)" in err


def test_bad_baseline(sweep, capsys):
    assert report.main([str(sweep), "--baseline", "callbacks.seq_warmup.duration=0.7"]) == 2
    assert "no job has it" in capsys.readouterr().err
    make_job(sweep, "3", ["callbacks.seq_warmup.duration=0.9", "trainer.max_steps=30"], None, status="failed")
    assert report.main([str(sweep), "--baseline", "callbacks.seq_warmup.duration=0.9"]) == 2
    assert "recorded no validation loss" in capsys.readouterr().err
    assert report.main([str(sweep), "--baseline", "nonsense"]) == 2
    assert "key=value" in capsys.readouterr().err


def seeded_sweep(root):
    """Two durations x three seeds. Baseline seeds end at 4.0, 4.2, 4.4 (target: 4.4, the highest); warmup
    reaches 4.4 with 1000 fewer tokens than its own seed's baseline (deterministic gain) and in times that
    straddle the baseline's (timing noise)."""
    tokens_base, tokens_warm = [3000, 3100, 2900], [2000, 2100, 1900]
    times_base, times_warm = [30.0, 20.0, 40.0], [25.0, 35.0, 20.0]
    job = 0
    for seed in range(3):
        for duration, tokens, times in (("0.0", tokens_base, times_base), ("0.3", tokens_warm, times_warm)):
            final = 4.0 + 0.2 * seed if duration == "0.0" else 3.9
            # Two validations: 5.0 half-way, then the final loss.
            rows = [(10, times[seed] / 2, tokens[seed] // 2, 5.0), (20, times[seed], tokens[seed], final)]
            make_job(root, str(job), [f"seed={seed}", f"callbacks.seq_warmup.duration={duration}"], rows)
            job += 1
    return root


def test_seeds_group_into_mean_and_sd(tmp_path):
    rep = report.write_report(str(seeded_sweep(tmp_path)))
    assert rep["seed_key"] == "seed" and rep["target"] == 4.4
    groups = {g["group"]: g for g in rep["groups"]}
    assert set(groups) == {"callbacks.seq_warmup.duration=0.0", "callbacks.seq_warmup.duration=0.3"}
    base, warm = groups["callbacks.seq_warmup.duration=0.0"], groups["callbacks.seq_warmup.duration=0.3"]
    assert base["baseline"] and base["seeds"] == 3 and base["reached"] == 3
    assert base["final_val_loss_mean"] == pytest.approx(4.2) and base["final_val_loss_sd"] == pytest.approx(0.2)
    # Each job's own figures, by linear interpolation between (5.0 at half) and the final loss.
    rows = {r["job"]: r for r in rep["rows"]}
    # seed 0: 1500 + 1500 * 0.6 / 1.0; seed 1: 1550 + 1550 * 0.6 / 0.8; seed 2 ends exactly at the target.
    assert [rows[str(j)]["tokens_to_target"] for j in (0, 2, 4)] == [2400, 2712, 2900]
    assert warm["tokens_to_target_mean"] < base["tokens_to_target_mean"]
    assert warm["speedup_tokens"] == pytest.approx(base["tokens_to_target_mean"] / warm["tokens_to_target_mean"])
    assert warm["tokens_noise"] == "beyond noise"  # every seed gains about the same
    assert warm["time_noise"] == "within noise"  # the times straddle the baseline's
    # Job speed-ups are against the baseline of the same seed.
    assert rows["1"]["speedup_tokens"] == pytest.approx(
        rows["0"]["tokens_to_target"] / rows["1"]["tokens_to_target"], rel=1e-3
    )
    md = (tmp_path / "report.md").read_text()
    assert "Mean ± sd over seed" in md and "3/3 finished" in md and "(within noise)" in md
    with open(tmp_path / "report_seeds.csv") as f:
        assert len(list(csv.DictReader(f))) == 2


def test_training_loss_is_plotted(tmp_path):
    job = make_job(tmp_path, "0", ["a=1"], [(10, 10.0, 100, 5.0)])
    with open(job / "train_progress.csv", "w") as f:
        f.write("step,wall_clock_s,cpu_s,tokens_seen,train_loss\n5,5.0,5.0,50,6.0\n10,10.0,10.0,100,5.5\n")
    make_job(tmp_path, "1", ["a=2"], [(10, 10.0, 100, 4.0)])
    jobs = load_jobs(str(tmp_path))
    assert [r["train_loss"] for r in jobs[0].train_rows] == [6.0, 5.5] and jobs[1].train_rows == []
    rep = report.write_report(str(tmp_path))
    assert rep["groups"] == [] and str(tmp_path / "report.png") in rep["files"]


def _legend_lines(ax):
    """The labelled curves of one panel (the target line apart)."""
    return [line for line in ax.lines if not line.get_label().startswith(("_", "target"))]


def test_plot_with_seeds_has_one_line_per_setting_with_a_band_and_the_target(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.collections import PolyCollection

    jobs = load_jobs(str(seeded_sweep(tmp_path)))
    rep = report.build_report(jobs)
    fig = report.figure(jobs, rep)
    for ax in fig.axes:  # validation loss against CPU time and against tokens
        lines = _legend_lines(ax)
        assert [line.get_label() for line in lines] == [
            "callbacks.seq_warmup.duration=0.0 (mean of 3)",
            "callbacks.seq_warmup.duration=0.3 (mean of 3)",
        ]
        bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
        assert len(bands) == 2
        [target] = [line for line in ax.lines if line.get_label().startswith("target")]
        assert target.get_ydata()[0] == rep["target"] == 4.4
    # The mean and the band of the baseline against tokens: seeds end at 4.0, 4.2, 4.4 on the common range.
    tokens = fig.axes[1]
    base = _legend_lines(tokens)[0]
    assert base.get_xdata()[-1] == 2900  # the range every seed covers ends where the shortest seed ends
    xs, ys = np.asarray(tokens.collections[0].get_paths()[0].vertices).T
    end = ys[xs == 2900]  # the seeds at 2,900 tokens: 4.067 (seed 0), 4.303 (seed 1), 4.4 (seed 2, its last point)
    assert min(end) == pytest.approx(4.0 + 100 / 1500) and max(end) == pytest.approx(4.4)
    assert base.get_ydata()[-1] == pytest.approx((4.0 + 100 / 1500 + 5.0 - 0.8 * 1350 / 1550 + 4.4) / 3)
    assert tokens.get_xlabel() == "real tokens trained on"
    assert "mean over its seeds, band min-max" in fig._suptitle.get_text()

    per_job = report.figure(jobs, rep, per_job=True)
    assert len(_legend_lines(per_job.axes[0])) == 2  # one legend entry per setting...
    assert len([line for line in per_job.axes[0].lines if not line.get_label().startswith("target")]) == 6  # six jobs
    assert not [c for c in per_job.axes[0].collections if isinstance(c, PolyCollection)]


def test_per_job_option_on_the_command_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert report.main([str(seeded_sweep(tmp_path)), "--per-job", "--name", "jobs"]) == 0
    assert (tmp_path / "jobs.png").stat().st_size > 10_000 and "jobs.png" in capsys.readouterr().out
