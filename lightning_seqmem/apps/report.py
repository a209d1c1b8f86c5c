"""``seqmem-report <sweep dir>``: one table and one plot for a Hydra sweep of ``seqmem-train``.

Each job folder of the sweep holds ``.hydra/overrides.yaml`` (what the job changed), ``progress.csv`` (one row per
validation: step, wall-clock, real tokens seen, val loss; written by ``JobRecord``) and ``job_status.json``
(``run_files``; read back by ``sweep_jobs``). The report compares every job with a baseline job: the wall-clock
and tokens each needs to reach a target validation loss (by default the loss the baseline ends at), and the
speed-up that gives. It works for a sweep over any parameter; jobs that failed or never validated are listed, not
fatal. This module computes the report and writes its files; ``report_tables`` formats its markdown tables. Plain
Python: no torch, no Lightning.

Seeds: when the sweep varies ``seed`` (or any ``*.seed``), the jobs that differ only by it form a group, and a
second table gives each group's mean ± sd over seeds of the final loss, time to target and tokens to target, with
the speed-up of the means and whether the gain is beyond the noise of the seeds. The default target is then the
highest final loss among the baseline's seeds (a loss every baseline seed reaches), and each job's own speed-up
is against the baseline job of the same seed.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys

from lightning_seqmem.apps.report_tables import markdown
from lightning_seqmem.apps.run_files import PROGRESS_FILE
from lightning_seqmem.apps.sweep_jobs import (
    DID_NOT_FINISH,
    Job,
    ReportError,
    label,
    load_jobs,
    seed_groups,
    seed_key,
    varying_keys,
)

__all__ = ["build_report", "figure", "main", "pick_baseline", "reach", "write_report"]

CLOCKS = {"wall": "wall_clock_s", "cpu": "cpu_s"}  # --clock choice -> progress.csv column


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


def _mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def _beyond_noise(base: list[float], other: list[float]) -> str:
    """Whether two sets of per-seed figures differ by more than twice the standard error of the difference."""
    if len(base) < 2 or len(other) < 2:
        return "one seed: no spread"
    se = math.sqrt(statistics.variance(base) / len(base) + statistics.variance(other) / len(other))
    diff = abs(statistics.fmean(base) - statistics.fmean(other))
    if se == 0:
        return "beyond noise" if diff > 0 else "no difference"
    return "beyond noise" if diff > 2 * se else "within noise"


def _group_rows(groups: dict[str, list[Job]], rows: dict[str, dict], base_label: str) -> list[dict]:
    """Mean ± sd over seeds of each group's final loss and time / tokens to target (finished jobs only: a killed
    job's last validation is not its final loss)."""

    def figures(members: list[Job], key: str) -> list[float]:
        return [rows[j.name][key] for j in members if j.finished and rows[j.name][key] is not None]

    base = {key: figures(groups[base_label], key) for key in ("time_to_target_s", "tokens_to_target")}
    out = []
    for name, members in groups.items():
        entry: dict = {
            "group": name,
            "baseline": name == base_label,
            "seeds": len(members),
            "finished": sum(j.finished for j in members),
        }
        for key, column in (
            ("final_val_loss", "final_val_loss"),
            ("time_to_target_s", "time_to_target_s"),
            ("tokens_to_target", "tokens_to_target"),
        ):
            entry[f"{column}_mean"], entry[f"{column}_sd"] = _mean_sd(figures(members, key))
        entry["reached"] = len(figures(members, "time_to_target_s"))  # of the finished seeds
        for what, key in (("time", "time_to_target_s"), ("tokens", "tokens_to_target")):
            mine, theirs = entry[f"{key}_mean"], statistics.fmean(base[key]) if base[key] else None
            entry[f"speedup_{what}"] = theirs / mine if theirs and mine else None
            entry[f"{what}_noise"] = None if name == base_label else _beyond_noise(base[key], figures(members, key))
        out.append(entry)
    return out


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
            raise ReportError(
                f"--baseline {baseline}: job {matches[0].name} recorded no validation loss "
                f"({matches[0].status}); pick another baseline."
            )
        return matches[0]
    for job in with_rows:
        for key, value in job.overrides.items():
            if key.split(".")[-1] == "duration" and _same_value(value, "0"):
                return job
    return with_rows[0]


def build_report(
    jobs: list[Job], target_loss: float | None = None, baseline: str | None = None, clock: str = "wall"
) -> dict:
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
    keys = varying_keys(jobs)
    skey = seed_key(keys)
    groups = seed_groups(jobs, keys) if skey else {}
    base_label = label(base, [k for k in keys if k != skey])
    base_seeds = [j for j in groups.get(base_label, [base]) if j.rows]
    finished_seeds = [j for j in base_seeds if j.finished] or base_seeds
    # A loss every baseline seed reaches: the highest of their final losses (one seed: the baseline's final loss).
    target = float(target_loss) if target_loss is not None else max(j.final["val_loss"] for j in finished_seeds)

    def paired_base(job: Job) -> Job:
        """The baseline job to compare with: of the same seed when the sweep has seeds."""
        if skey is None:
            return base
        same = [j for j in base_seeds if j.overrides.get(skey) == job.overrides.get(skey)]
        return same[0] if same else base

    rows = []
    sources = list(dict.fromkeys(name for job in jobs for name in job.source_losses))  # a Mix's, in first-seen order
    for job in jobs:
        final = job.final or {}
        t = reach(job.rows, target, time_key) if job.rows else None
        n = reach(job.rows, target, "tokens_seen") if job.rows and "tokens_seen" in final else None
        ref = paired_base(job)
        base_time = reach(ref.rows, target, time_key)
        base_tokens = reach(ref.rows, target, "tokens_seen") if "tokens_seen" in ref.final else None
        rows.append(
            {
                "job": job.name,
                "overrides": label(job, keys),
                "baseline": job is base or (skey is not None and job in base_seeds),
                "status": job.status,
                "steps": int(final["step"]) if "step" in final else None,
                "final_val_loss": final.get("val_loss"),
                "time_s": final.get(time_key),
                "tokens_seen": int(final["tokens_seen"]) if "tokens_seen" in final else None,
                "time_to_target_s": t,
                "tokens_to_target": round(n) if n is not None else None,
                "speedup_time": base_time / t if base_time and t else None,
                "speedup_tokens": base_tokens / n if base_tokens and n else None,
                **{f"final_val_loss/{name}": job.source_losses.get(name) for name in sources},
            }
        )
    group_rows = _group_rows(groups, {r["job"]: r for r in rows}, base_label) if skey else []
    notes = []
    common = {k: v for k, v in jobs[0].overrides.items() if k not in keys}
    if common:
        notes.append("Every job: " + " ".join(f"{k}={v}" for k, v in common.items()))
    unfinished = [job for job in jobs if not job.finished]
    for job in unfinished:
        what = f"{len(job.rows)} validation point(s) kept" if job.rows else "no metrics"
        status = "" if job.status == DID_NOT_FINISH else f": {job.status}"
        notes.append(
            f"Job {job.name} ({label(job, keys)}) did not finish{status}"
            + (f" — {job.error}" if job.error else "")
            + f"; {what}."
        )
    return {
        "rows": rows,
        "baseline": base,
        "target": target,
        "keys": keys,
        "notes": notes,
        "target_given": target_loss is not None,
        "clock": clock,
        "time_key": time_key,
        "seed_key": skey,
        "groups": group_rows,
        "sources": sources,
    }


# ------------------------------------------------------------------------------------------------------- output
def figure(jobs: list[Job], report: dict, per_job: bool = False):
    """Loss against time and against tokens (``plots.sweep_curves``): one line per setting, the mean over its seeds
    with a min-max band, or with ``per_job`` one line per job. Raises ``ImportError`` without matplotlib."""
    from lightning_seqmem.apps.plots import sweep_curves

    keys = report["keys"]
    groups = seed_groups(jobs, keys) if report["seed_key"] else {label(job, keys): [job] for job in jobs}
    clock = "wall-clock" if report["clock"] == "wall" else "CPU time"
    return sweep_curves(groups, report["time_key"], report["target"], clock, per_job)


def write_report(
    sweep_dir: str,
    out_dir: str | None = None,
    target_loss: float | None = None,
    baseline: str | None = None,
    name: str = "report",
    clock: str = "wall",
    per_job: bool = False,
) -> dict:
    """Build the report for ``sweep_dir`` and write ``<name>.md``, ``<name>.csv`` (one row per job),
    ``<name>_seeds.csv`` (one row per configuration, when the sweep varies a seed) and ``<name>.png`` to ``out_dir``
    (one line per setting, mean and min-max band over seeds; ``per_job``: one line per job).

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
            writer.writerow(
                {
                    **row,
                    "clock": report["time_key"],
                    "all_overrides": " ".join(f"{k}={v}" for k, v in job.overrides.items()),
                    "target_val_loss": report["target"],
                }
            )
    if report["groups"]:
        files.append(os.path.join(out_dir, f"{name}_seeds.csv"))
        with open(files[-1], "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(report["groups"][0]) + ["seed_key", "clock", "target_val_loss"])
            writer.writeheader()
            for group in report["groups"]:
                writer.writerow(
                    {
                        **group,
                        "seed_key": report["seed_key"],
                        "clock": report["time_key"],
                        "target_val_loss": report["target"],
                    }
                )
    png = os.path.join(out_dir, f"{name}.png")
    try:
        figure(jobs, report, per_job).savefig(png, dpi=120)
    except ImportError:  # matplotlib is optional: the tables are written without the picture
        pass
    else:
        files.append(png)
        with open(files[0], "a") as f:
            f.write(f"\n![loss against wall-clock and tokens]({os.path.basename(png)})\n")
    report["files"] = files
    return report


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point (``seqmem-report``)."""
    parser = argparse.ArgumentParser(
        prog="seqmem-report", description="Aggregate a seqmem-train sweep: table (markdown, CSV) and plot (PNG)."
    )
    parser.add_argument("sweep_dir", help="the sweep folder (multirun/<date>/<time> or your hydra.sweep.dir)")
    parser.add_argument(
        "--target-loss",
        type=float,
        default=None,
        help="validation loss to reach; default: what the baseline job ends at",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="KEY=VALUE",
        help="the job to compare with, by an override it has; default: the job with *.duration=0, else the first job",
    )
    parser.add_argument("--out", default=None, help="folder for report.md/.csv/.png; default: the sweep folder")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="time axis: training wall-clock (default) or process CPU time (steadier when other "
        "work shares the machine)",
    )
    parser.add_argument("--name", default="report", help="file name stem of the outputs (default: report)")
    parser.add_argument(
        "--per-job",
        action="store_true",
        help="plot one line per job instead of one per setting (mean over seeds, min-max band)",
    )
    args = parser.parse_args(argv)
    try:
        report = write_report(
            args.sweep_dir, args.out, args.target_loss, args.baseline, args.name, args.clock, args.per_job
        )
    except ReportError as err:
        print(f"seqmem-report: {err}", file=sys.stderr)
        return 2
    print(report["markdown"])
    print("Wrote " + ", ".join(report["files"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
