"""Which process of a many-node job this is, and the one run folder every process of the job agrees on.

``seqmem-train`` runs once per process under ``torchrun`` and ``srun`` (each node's launcher starts its own), and
under Lightning's own DDP launcher (which re-runs the script per extra rank). Before Hydra composes, each process
must know whether it is the job's rank zero (the one that writes the run's files) and which folder the job writes
to: Hydra's default, a timestamp taken by each process, would give each node a folder of its own.

The rank is read as Lightning reads it (``RANK`` from torchrun, Lightning's ``LOCAL_RANK``/``NODE_RANK``, then
``SLURM_PROCID`` where ``srun`` launched the job). The folder is named after the job's id where the launcher gives
one (``SLURM_JOB_ID``, ``TORCHELASTIC_RUN_ID``), else rank zero's timestamp is handed to the others through the
rendezvous store torchrun's agent already runs. Nothing here imports torch unless that store is needed.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence

__all__ = ["global_rank", "is_rank_zero", "job_id", "launched_processes", "run_dir_overrides"]

RUN_ROOT = "outputs"  # where conf/hydra/seqmem.yaml puts runs; a job's agreed folder goes there too
_INTERACTIVE_SLURM_NAMES = ("bash", "interactive")  # salloc shells: Lightning launches, not srun (as Lightning)
STORE_TIMEOUT_S = 600.0  # how long a rank waits for rank zero's folder name (rank zero may import slowly)


def _srun_launched(env: Mapping[str, str]) -> bool:
    return "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in _INTERACTIVE_SLURM_NAMES


def _torchrun_launched(env: Mapping[str, str]) -> bool:
    return "TORCHELASTIC_RUN_ID" in env and "RANK" in env


def global_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's rank in the whole job, from the launcher's variables (0 for a job of one process).

    ``RANK`` (torchrun, and anything that sets it), then Lightning's own launcher (``NODE_RANK``, ``LOCAL_RANK``),
    then ``SLURM_PROCID`` where ``srun`` started the
    tasks. Lightning checks ``LOCAL_RANK`` before ``SLURM_PROCID`` too: an interactive SLURM shell sets the latter
    for every process Lightning launches.
    """
    env = os.environ if env is None else env
    if "RANK" in env:
        return int(env["RANK"])
    if "LOCAL_RANK" in env or "NODE_RANK" in env:
        local, node = int(env.get("LOCAL_RANK", 0)), int(env.get("NODE_RANK", 0))
        return local + node * 1000  # its launcher does not say how many a node runs: zero told apart, others distinct
    if _srun_launched(env) and "SLURM_PROCID" in env:
        return int(env["SLURM_PROCID"])
    return 0


def is_rank_zero(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is the job's rank zero: the one that checks the data early and writes the run's files."""
    return global_rank(env) == 0


def launched_processes(env: Mapping[str, str] | None = None) -> int:
    """How many processes the launcher started for this job (``WORLD_SIZE``, ``SLURM_NTASKS``), 1 without one."""
    env = os.environ if env is None else env
    if _torchrun_launched(env) and "WORLD_SIZE" in env:
        return int(env["WORLD_SIZE"])
    if _srun_launched(env):
        return int(env["SLURM_NTASKS"])
    return 1


def job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The job's own name, the same on every node: ``slurm-<job id>[.<step id>]`` or ``torchrun-<run id>``;
    ``None`` where the launcher gives none (torchrun's ``--rdzv-id`` defaults to ``none``)."""
    env = os.environ if env is None else env
    if _srun_launched(env) and env.get("SLURM_JOB_ID"):
        step = env.get("SLURM_STEP_ID")
        return f"slurm-{env['SLURM_JOB_ID']}" + (f".{step}" if step not in (None, "", "0") else "")
    run = env.get("TORCHELASTIC_RUN_ID")
    if _torchrun_launched(env) and run and run != "none":
        return f"torchrun-{run}"
    return None


def _gives(argv: Sequence[str], key: str) -> bool:
    return any(a.split("=", 1)[0].lstrip("+~") == key for a in argv)


def _from_rank_zero(env: Mapping[str, str], proposal: str) -> str | None:
    """Rank zero's ``proposal`` on every rank, through the TCP store torchrun's agent on node 0 hosts at
    ``MASTER_ADDR:MASTER_PORT`` (the store ``init_process_group`` will join); ``None`` where there is no such
    store (a rendezvous backend whose store rank zero's process group will host)."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in env:
        return None
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S)
    )
    key = f"lightning_seqmem/run_dir/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if int(env["RANK"]) == 0:
        store.set(key, proposal)
        return proposal
    return store.get(key).decode()


def run_dir_overrides(argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """The Hydra overrides that put every process of a many-process job in one folder, written by rank zero only.

    Nothing changes for a job of one process, a multirun (``-m``), or a folder given with ``hydra.run.dir``.
    Otherwise the folder is ``outputs/<job id>`` (``job_id``) or rank zero's ``outputs/<date>/<time>``; the other
    ranks leave ``.hydra/`` to rank zero and log to a file named after their rank, as Lightning's own launcher
    has its children do.
    """
    env = os.environ if env is None else env
    if launched_processes(env) <= 1 or any(a in ("-m", "--multirun") for a in argv):
        return list(argv)
    added: list[str] = []
    if not _gives(argv, "hydra.run.dir"):
        name = job_id(env)
        folder = os.path.join(RUN_ROOT, name) if name else None
        if folder is None and _torchrun_launched(env):
            folder = _from_rank_zero(env, os.path.join(RUN_ROOT, time.strftime("%Y-%m-%d/%H-%M-%S")))
        if folder is None:
            if is_rank_zero(env):
                print(
                    "[lightning_seqmem] This job has no id that every node shares (torchrun --rdzv-id, "
                    "SLURM_JOB_ID): each node writes its own run folder. Give one with hydra.run.dir=<folder>.",
                    file=sys.stderr,
                )
        else:
            added.append(f"hydra.run.dir={folder}")
    rank = global_rank(env)
    if rank != 0:
        added += ["hydra.output_subdir=null", f"hydra.job.name=seqmem-train_rank{rank}"]
    return [*argv, *added]
