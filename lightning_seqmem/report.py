"""``seqmem-report <sweep dir>``: one table and one plot for a Hydra sweep of ``seqmem-train``.

Each job folder of the sweep holds ``.hydra/overrides.yaml`` (what the job changed), ``progress.csv`` (one row per
validation: step, wall-clock, real tokens seen, val loss; written by ``JobRecord``) and ``job_status.json``. The
report compares every job with a baseline job: the wall-clock and tokens each needs to reach a target validation
loss (by default the loss the baseline ends at), and the speed-up that gives. It works for a sweep over any
parameter; jobs that failed or never validated are listed, not fatal. Plain Python: no torch, no Lightning.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from dataclasses import dataclass, field

__all__ = ["Job", "ReportError", "build_report", "load_jobs", "main", "reach", "write_report"]

PROGRESS_FILE = "progress.csv"
CLOCKS = {"wall": "wall_clock_s", "cpu": "cpu_s"}  # --clock choice -> progress.csv column


class ReportError(Exception):
    """Nothing to report: the message says what was expected where."""


@dataclass
class Job:
    """One job of a sweep: its folder, its command-line overrides, its status and its validation curve."""

    path: str
    name: str
    overrides: dict[str, str]
    status: str
    error: str | None = None
    rows: list[dict[str, float]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.status == "finished"

    @property
    def final(self) -> dict[str, float] | None:
        return self.rows[-1] if self.rows else None


# ------------------------------------------------------------------------------------------------------ loading
def _read_overrides(job_dir: str) -> dict[str, str]:
    import yaml

    with open(os.path.join(job_dir, ".hydra", "overrides.yaml")) as f:
        items = yaml.safe_load(f) or []
    overrides = {}
    for item in items:
        key, _, value = str(item).partition("=")
        overrides[key.lstrip("+")] = value  # "~key" (deleted) stays as it is
    return overrides


def _read_progress(job_dir: str) -> list[dict[str, float]]:
    path = os.path.join(job_dir, PROGRESS_FILE)
    if not os.path.exists(path):
        return []
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            try:
                rows.append({k: float(v) for k, v in row.items() if v not in (None, "")})
            except ValueError:  # a half-written last line of a killed job
                continue
    return sorted((r for r in rows if "val_loss" in r and "wall_clock_s" in r), key=lambda r: r.get("step", 0))


def _read_status(job_dir: str) -> tuple[str, str | None]:
    path = os.path.join(job_dir, "job_status.json")
    if os.path.exists(path):
        try:
            with open(path) as f:
                record = json.load(f)
            status = record.get("status", "unknown")
            return ("did not finish" if status == "running" else status), record.get("error")
        except (OSError, ValueError):
            pass
    if os.path.exists(os.path.join(job_dir, "summary.json")):
        return "finished", None
    return "did not finish", None


def _job_dirs(sweep_dir: str) -> list[str]:
    found = []
    for root, dirs, _ in os.walk(sweep_dir):
        if os.path.exists(os.path.join(root, ".hydra", "overrides.yaml")):
            found.append(root)
            dirs.clear()  # a job's own sub-folders (logs, DDP ranks) are not jobs
        else:
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))

    def key(path: str):
        name = os.path.relpath(path, sweep_dir)
        return (0, int(name), "") if name.isdigit() else (1, 0, name)

    return sorted(found, key=key)


def load_jobs(sweep_dir: str) -> list[Job]:
    """Every Hydra job folder under ``sweep_dir`` (the folder itself when it is a single run).

    Raises:
        ReportError: the folder does not exist or holds no job folders.
    """
    if not os.path.isdir(sweep_dir):
        raise ReportError(f"{sweep_dir!r} is not a directory. Pass the sweep folder seqmem-train -m printed "
                          "(multirun/<date>/<time> by default, or your hydra.sweep.dir).")
    dirs = _job_dirs(sweep_dir)
    if not dirs:
        raise ReportError(f"No jobs in {sweep_dir!r}: expected job folders with .hydra/overrides.yaml, as "
                          "`seqmem-train -m ...` writes them. Is this the sweep folder, and did any job start?")
    jobs = []
    for path in dirs:
        status, error = _read_status(path)
        name = os.path.relpath(path, sweep_dir)
        jobs.append(Job(path=path, name="." if name == "." else name, overrides=_read_overrides(path),
                        status=status, error=error, rows=_read_progress(path)))
    return jobs


# ----------------------------------------------------------------------------------------------------- analysis
def reach(rows: list[dict[str, float]], target: float, key: str) -> float | None:
    """The ``key`` (wall-clock or tokens) at which the validation loss first gets to ``target``, or None.

    Linear interpolation between the last validation above the target and the first at or below it.

    Example::

        reach([{"val_loss": 4.0, "t": 10}, {"val_loss": 2.0, "t": 20}], 3.0, "t")  # 15.0
    """
    previous = None
    for row in rows:
        if row["val_loss"] <= target:
            if previous is None or previous["val_loss"] == row["val_loss"]:
                return row[key]
            frac = (previous["val_loss"] - target) / (previous["val_loss"] - row["val_loss"])
            return previous[key] + frac * (row[key] - previous[key])
        previous = row
    return None


def _same_value(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a.strip("'\"") == b.strip("'\"")


def varying_keys(jobs: list[Job]) -> list[str]:
    """Override keys whose value is not the same in every job (what the sweep varied)."""
    keys = list(dict.fromkeys(k for job in jobs for k in job.overrides))
    return [k for k in keys if len({job.overrides.get(k) for job in jobs}) > 1]


def label(job: Job, keys: list[str]) -> str:
    shown = [f"{k}={job.overrides[k]}" for k in keys if k in job.overrides]
    return ", ".join(shown) if shown else f"job {job.name}"


def pick_baseline(jobs: list[Job], baseline: str | None) -> Job:
    """The job named by ``key=value``; else the one with a ``*duration`` override equal to 0; else the first.

    Raises:
        ReportError: ``baseline`` matches no job, or matches one without metrics.
    """
    with_rows = [job for job in jobs if job.rows]
    if baseline is not None:
        key, sep, value = baseline.partition("=")
        if not sep:
            raise ReportError(f"--baseline takes key=value (e.g. callbacks.seq_warmup.duration=0.0), got {baseline!r}.")
        matches = [job for job in jobs if key in job.overrides and _same_value(job.overrides[key], value)]
        if not matches:
            seen = sorted({f"{key}={job.overrides[key]}" for job in jobs if key in job.overrides})
            raise ReportError(f"--baseline {baseline}: no job has it. Jobs have: {seen or 'no override ' + key}.")
        if not matches[0].rows:
            raise ReportError(f"--baseline {baseline}: job {matches[0].name} recorded no validation loss "
                              f"({matches[0].status}); pick another baseline.")
        return matches[0]
    for job in with_rows:
        for key, value in job.overrides.items():
            if key.split(".")[-1] == "duration" and _same_value(value, "0"):
                return job
    return with_rows[0]


def build_report(jobs: list[Job], target_loss: float | None = None, baseline: str | None = None,
                 clock: str = "wall") -> dict:
    """The rows of the report, the baseline, the target and the notes.

    ``clock`` is ``"wall"`` (training wall-clock) or ``"cpu"`` (process CPU time, steadier on a shared machine).

    Raises:
        ReportError: no job recorded any validation loss.
    """
    if not any(job.rows for job in jobs):
        listing = ", ".join(f"{job.name} ({job.status})" for job in jobs)
        raise ReportError(
            f"None of the {len(jobs)} jobs recorded metrics ({PROGRESS_FILE} with val_loss): {listing}. Jobs need "
            "the job_record callback (on in callbacks=default) and at least one validation "
            "(trainer.val_check_interval <= trainer.max_steps)."
        )
    if clock not in CLOCKS:
        raise ReportError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}.")
    time_key = CLOCKS[clock]
    if not all(time_key in job.rows[0] for job in jobs if job.rows):
        raise ReportError(f"Some jobs' {PROGRESS_FILE} have no {time_key} column; use --clock wall.")
    base = pick_baseline(jobs, baseline)
    target = float(target_loss) if target_loss is not None else base.final["val_loss"]
    keys = varying_keys(jobs)
    base_time = reach(base.rows, target, time_key)
    base_tokens = reach(base.rows, target, "tokens_seen") if "tokens_seen" in base.final else None
    rows = []
    for job in jobs:
        final = job.final or {}
        t = reach(job.rows, target, time_key) if job.rows else None
        n = reach(job.rows, target, "tokens_seen") if job.rows and "tokens_seen" in final else None
        rows.append({
            "job": job.name,
            "overrides": label(job, keys),
            "baseline": job is base,
            "status": job.status,
            "steps": int(final["step"]) if "step" in final else None,
            "final_val_loss": final.get("val_loss"),
            "time_s": final.get(time_key),
            "tokens_seen": int(final["tokens_seen"]) if "tokens_seen" in final else None,
            "time_to_target_s": t,
            "tokens_to_target": int(n) if n is not None else None,
            "speedup_time": base_time / t if base_time and t else None,
            "speedup_tokens": base_tokens / n if base_tokens and n else None,
        })
    notes = []
    common = {k: v for k, v in jobs[0].overrides.items() if k not in keys}
    if common:
        notes.append("Every job: " + " ".join(f"{k}={v}" for k, v in common.items()))
    unfinished = [job for job in jobs if not job.finished]
    for job in unfinished:
        what = f"{len(job.rows)} validation point(s) kept" if job.rows else "no metrics"
        notes.append(f"Job {job.name} ({label(job, keys)}) did not finish: {job.status}"
                     + (f" — {job.error}" if job.error else "") + f"; {what}.")
    return {"rows": rows, "baseline": base, "target": target, "keys": keys, "notes": notes,
            "target_given": target_loss is not None, "clock": clock, "time_key": time_key}


# ------------------------------------------------------------------------------------------------------- output
def _fmt(value, kind: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if kind == "x":
        return f"{value:.2f}×"
    if kind == "loss":
        return f"{value:.4f}"
    if kind == "s":
        return f"{value:.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def markdown(report: dict) -> str:
    base = report["baseline"]
    source = "given" if report["target_given"] else "baseline's final val loss"
    clock = "wall-clock" if report["clock"] == "wall" else "CPU time"
    head = ["job", "overrides", "status", "steps", "final val loss", f"{clock} (s)", "tokens seen",
            "time to target (s)", "tokens to target", "speed-up (time)", "speed-up (tokens)"]
    lines = [
        f"Target val loss: **{report['target']:.4f}** ({source}); baseline: job {base.name} "
        f"({label(base, report['keys'])}). Times are training {clock}, validation excluded.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" if i < 3 else "---:" for i in range(len(head))) + "|",
    ]
    for r in report["rows"]:
        cells = [r["job"] + (" (baseline)" if r["baseline"] else ""), r["overrides"], r["status"], _fmt(r["steps"]),
                 _fmt(r["final_val_loss"], "loss"), _fmt(r["time_s"], "s"), _fmt(r["tokens_seen"]),
                 _fmt(r["time_to_target_s"], "s") if r["time_to_target_s"] is not None else "not reached",
                 _fmt(r["tokens_to_target"]) if r["tokens_to_target"] is not None else "not reached",
                 _fmt(r["speedup_time"], "x"), _fmt(r["speedup_tokens"], "x")]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    if report["notes"]:
        lines += [""] + [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def plot(jobs: list[Job], report: dict, path: str) -> bool:
    """Validation loss against wall-clock (and against tokens), one curve per job. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for job in jobs:
        if not job.rows:
            continue
        name = label(job, report["keys"]) + ("" if job.finished else f" ({job.status})")
        style = "-" if job.finished else ":"
        for ax, key in zip(axes, (report["time_key"], "tokens_seen")):
            if key in job.rows[0]:
                ax.plot([r[key] for r in job.rows], [r["val_loss"] for r in job.rows], style, marker="o",
                        markersize=3, label=name)
    clock = "wall-clock" if report["clock"] == "wall" else "CPU time"
    for ax, xlabel in zip(axes, (f"training {clock} (s, validation excluded)", "real tokens trained on")):
        ax.axhline(report["target"], color="grey", linestyle="--", linewidth=0.8, label="target")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(sweep_dir: str, out_dir: str | None = None, target_loss: float | None = None,
                 baseline: str | None = None, name: str = "report", clock: str = "wall") -> dict:
    """Build the report for ``sweep_dir`` and write ``<name>.md``, ``<name>.csv`` and ``<name>.png`` to ``out_dir``.

    Returns the report dict plus ``markdown`` and the ``files`` written.

    Raises:
        ReportError: no jobs, no metrics, or a baseline that matches nothing.
    """
    jobs = load_jobs(sweep_dir)
    report = build_report(jobs, target_loss=target_loss, baseline=baseline, clock=clock)
    out_dir = out_dir or sweep_dir
    os.makedirs(out_dir, exist_ok=True)
    report["markdown"] = markdown(report)
    files = [os.path.join(out_dir, f"{name}.md"), os.path.join(out_dir, f"{name}.csv")]
    with open(files[0], "w") as f:
        f.write(f"# Sweep report: {os.path.abspath(sweep_dir)}\n\n")
        f.write(report["markdown"])
    with open(files[1], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(report["rows"][0]) + ["clock", "all_overrides", "target_val_loss"])
        writer.writeheader()
        for job, row in zip(jobs, report["rows"]):
            writer.writerow({**row, "clock": report["time_key"], "all_overrides": " ".join(f"{k}={v}" for k, v in job.overrides.items()),
                             "target_val_loss": report["target"]})
    png = os.path.join(out_dir, f"{name}.png")
    if plot(jobs, report, png):
        files.append(png)
        with open(files[0], "a") as f:
            f.write(f"\n![validation loss against wall-clock and tokens]({os.path.basename(png)})\n")
    report["files"] = files
    return report


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point (``seqmem-report``)."""
    parser = argparse.ArgumentParser(
        prog="seqmem-report", description="Aggregate a seqmem-train sweep: table (markdown, CSV) and plot (PNG).")
    parser.add_argument("sweep_dir", help="the sweep folder (multirun/<date>/<time> or your hydra.sweep.dir)")
    parser.add_argument("--target-loss", type=float, default=None,
                        help="validation loss to reach; default: what the baseline job ends at")
    parser.add_argument("--baseline", default=None, metavar="KEY=VALUE",
                        help="the job to compare with, by an override it has; default: the job with "
                             "*.duration=0, else the first job")
    parser.add_argument("--out", default=None, help="folder for report.md/.csv/.png; default: the sweep folder")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="time axis: training wall-clock (default) or process CPU time (steadier when other "
                             "work shares the machine)")
    parser.add_argument("--name", default="report", help="file name stem of the outputs (default: report)")
    args = parser.parse_args(argv)
    try:
        report = write_report(args.sweep_dir, args.out, args.target_loss, args.baseline, args.name, args.clock)
    except ReportError as err:
        print(f"seqmem-report: {err}", file=sys.stderr)
        return 2
    print(report["markdown"])
    print("Wrote " + ", ".join(report["files"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
