"""The jobs of a sweep, read back from their run folders (``run_files``) for ``seqmem-report``.

A job folder is any folder under the sweep with Hydra's ``.hydra/overrides.yaml``; a job that failed, was killed or
never validated is still a job (its status says which), so the report can list it. Then what the sweep varied: the
override keys that differ between jobs, the job labels they make, and the seeds of one configuration grouped.
Plain Python: no torch, no Lightning.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field

from lightning_seqmem.apps.run_files import (
    FINISHED,
    JOB_STATUS_FILE,
    OVERRIDES_FILE,
    PROGRESS_FILE,
    RUNNING,
    SOURCE_PROGRESS_FILE,
    SUMMARY_FILE,
    TRAIN_PROGRESS_FILE,
)

__all__ = ["DID_NOT_FINISH", "Job", "ReportError", "label", "load_jobs", "seed_groups", "seed_key", "varying_keys"]

DID_NOT_FINISH = "did not finish"  # a job still "running" in its status file, or with no status and no summary


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
    train_rows: list[dict[str, float]] = field(default_factory=list)
    source_losses: dict[str, float] = field(default_factory=dict)  # a Mix: each source's last validation loss

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    @property
    def final(self) -> dict[str, float] | None:
        return self.rows[-1] if self.rows else None


def _read_overrides(job_dir: str) -> dict[str, str]:
    import yaml

    with open(os.path.join(job_dir, OVERRIDES_FILE)) as f:
        items = yaml.safe_load(f) or []
    overrides = {}
    for item in items:
        key, _, value = str(item).partition("=")
        overrides[key.lstrip("+")] = value  # "~key" (deleted) stays as it is
    return overrides


def _read_progress(job_dir: str, name: str = PROGRESS_FILE, loss: str = "val_loss") -> list[dict[str, float]]:
    path = os.path.join(job_dir, name)
    if not os.path.exists(path):
        return []
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            try:
                rows.append({k: float(v) for k, v in row.items() if v not in (None, "")})
            except ValueError:  # a half-written last line of a killed job
                continue
    return sorted((r for r in rows if loss in r and "wall_clock_s" in r), key=lambda r: r.get("step", 0))


def _read_source_losses(job_dir: str) -> dict[str, float]:
    """Each source's validation loss at the job's last validation (``JobRecord``'s ``val_sources.csv``)."""
    path = os.path.join(job_dir, SOURCE_PROGRESS_FILE)
    if not os.path.exists(path):
        return {}
    last: dict[str, tuple[float, float]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            try:
                step, loss = float(row["step"]), float(row["val_loss"])
            except (KeyError, TypeError, ValueError):  # a half-written last line of a killed job
                continue
            if row["source"] not in last or step >= last[row["source"]][0]:
                last[row["source"]] = (step, loss)
    return {name: loss for name, (_, loss) in last.items()}


def _read_status(job_dir: str) -> tuple[str, str | None]:
    path = os.path.join(job_dir, JOB_STATUS_FILE)
    if os.path.exists(path):
        try:
            with open(path) as f:
                record = json.load(f)
            status = record.get("status", "unknown")
            return (DID_NOT_FINISH if status == RUNNING else status), record.get("error")
        except (OSError, ValueError):
            pass
    if os.path.exists(os.path.join(job_dir, SUMMARY_FILE)):
        return FINISHED, None
    return DID_NOT_FINISH, None


def _job_dirs(sweep_dir: str) -> list[str]:
    found = []
    for root, dirs, _ in os.walk(sweep_dir):
        if os.path.exists(os.path.join(root, OVERRIDES_FILE)):
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
        raise ReportError(
            f"{sweep_dir!r} is not a directory. Pass the sweep folder seqmem-train -m printed "
            "(multirun/<date>/<time> by default, or your hydra.sweep.dir)."
        )
    dirs = _job_dirs(sweep_dir)
    if not dirs:
        raise ReportError(
            f"No jobs in {sweep_dir!r}: expected job folders with {OVERRIDES_FILE}, as "
            "`seqmem-train -m ...` writes them. Is this the sweep folder, and did any job start?"
        )
    jobs = []
    for path in dirs:
        status, error = _read_status(path)
        name = os.path.relpath(path, sweep_dir)
        jobs.append(
            Job(
                path=path,
                name="." if name == "." else name,
                overrides=_read_overrides(path),
                status=status,
                error=error,
                rows=_read_progress(path),
                train_rows=_read_progress(path, TRAIN_PROGRESS_FILE, "train_loss"),
                source_losses=_read_source_losses(path),
            )
        )
    return jobs


# --------------------------------------------------------------------------------------- what the sweep varied
def varying_keys(jobs: list[Job]) -> list[str]:
    """Override keys whose value is not the same in every job (what the sweep varied)."""
    keys = list(dict.fromkeys(k for job in jobs for k in job.overrides))
    return [k for k in keys if len({job.overrides.get(k) for job in jobs}) > 1]


def label(job: Job, keys: list[str]) -> str:
    shown = [f"{k}={job.overrides[k]}" for k in keys if k in job.overrides]
    return ", ".join(shown) if shown else f"job {job.name}"


def seed_key(keys: list[str]) -> str | None:
    """The varying override that is a seed (``seed``, ``data.seed``, ...), if any."""
    return next((k for k in keys if k.split(".")[-1] == "seed"), None)


def seed_groups(jobs: list[Job], keys: list[str]) -> dict[str, list[Job]]:
    """Jobs keyed by their label without the seed: the seeds of one configuration, in sweep order."""
    other = [k for k in keys if k != seed_key(keys)]
    groups: dict[str, list[Job]] = {}
    for job in jobs:
        groups.setdefault(label(job, other), []).append(job)
    return groups
