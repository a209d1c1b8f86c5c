"""Run folder: the files one ``seqmem-train`` job leaves in its folder, named once for their writers and readers.

::

    <run dir>/                  Hydra's job output dir, the Trainer's default_root_dir
    ├── .hydra/overrides.yaml   what the job changed on the command line     Hydra        -> sweep_jobs
    ├── job_status.json         running, finished, interrupted or failed     train.py     -> sweep_jobs
    ├── checkpoints/            last.ckpt and the newest step's checkpoint   RunCheckpoint -> ckpt_path=last
    ├── progress.csv            one row per validation (PROGRESS_FIELDS)     JobRecord    -> sweep_jobs
    ├── train_progress.csv      training loss rows (TRAIN_PROGRESS_FIELDS)   JobRecord    -> sweep_jobs
    └── summary.json            the run's summary table                      RunSummary   -> train.py, sweep_jobs

``seqmem-report`` reads a sweep of such folders (``sweep_jobs``); nothing here imports torch.
"""

from __future__ import annotations

import os

__all__ = [
    "FAILED",
    "FINISHED",
    "INTERRUPTED",
    "JOB_STATUS_FILE",
    "OVERRIDES_FILE",
    "PROGRESS_FIELDS",
    "PROGRESS_FILE",
    "RUNNING",
    "SUMMARY_FILE",
    "TRAIN_PROGRESS_FIELDS",
    "TRAIN_PROGRESS_FILE",
]

OVERRIDES_FILE = os.path.join(".hydra", "overrides.yaml")  # written by Hydra: how a folder is known to be a job
JOB_STATUS_FILE = "job_status.json"
PROGRESS_FILE = "progress.csv"
TRAIN_PROGRESS_FILE = "train_progress.csv"
SUMMARY_FILE = "summary.json"
SOURCE_PROGRESS_FILE = "val_sources.csv"  # a Mix: each source's validation loss at each validation

# The columns of progress.csv and train_progress.csv.
PROGRESS_FIELDS = ("step", "wall_clock_s", "elapsed_s", "cpu_s", "tokens_seen", "val_loss")
TRAIN_PROGRESS_FIELDS = ("step", "wall_clock_s", "cpu_s", "tokens_seen", "train_loss")
SOURCE_PROGRESS_FIELDS = ("step", "source", "val_loss")

# The values of job_status.json's "status": "interrupted" is a stop by a signal (SIGINT, SIGTERM), "failed" an error.
RUNNING, FINISHED, FAILED, INTERRUPTED = "running", "finished", "failed", "interrupted"
