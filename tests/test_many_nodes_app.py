"""seqmem-train on two simulated nodes of one machine: real launchers side by side (two ``torchrun --nnodes 2
--node_rank 0|1`` on 127.0.0.1, or the processes ``srun`` would start with its variables), gloo on the CPU.

The job writes one run folder (one ``job_status.json``, one ``summary.json``), and tokenizes each split once per
node with node-local caches and once for the whole job with a shared one (the entry lock, docs/many_machines.md).
Who tokenized is told by a ``sitecustomize`` on the children's path that notes each tokenization in a file.
"""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _forked_ranks import free_port

TINY = [
    "trainer=cpu",
    "trainer.strategy=ddp",
    "trainer.num_nodes=2",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "+trainer.enable_progress_bar=false",
    "+trainer.enable_model_summary=false",
    "data=local",
    "data.max_length=32",
    "data.micro_batch_size=2",
    "print_summary=false",
    "callbacks=summary",
    "~logger",
]

NOTE_TOKENIZING = """
import os
from lightning_seqmem.data import token_cache

_real = token_cache._tokenize_split

def _noted(ds, job, procs):
    with open(os.environ["SEQMEM_TEST_NOTES"], "a") as f:
        f.write(f"{os.environ.get('SEQMEM_TEST_NODE')} {job.split}\\n")
    return _real(ds, job, procs)

token_cache._tokenize_split = _noted
"""


def _launch(launcher: str, per_node: int, port: int, env: dict, cwd: Path, overrides: list) -> list:
    """The processes of both nodes, started side by side as each node's launcher would start them."""
    app = [sys.executable, "-m", "lightning_seqmem.apps.train"]
    procs = []
    for node in (0, 1):
        node_env = {**env, "SEQMEM_TEST_NODE": str(node), **overrides[node][1]}
        args = [*TINY, f"trainer.devices={per_node}", *overrides[node][0]]
        if launcher == "torchrun":
            run = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node)]
            run += ["--nproc-per-node", str(per_node), "--master_addr", "127.0.0.1", "--master_port", str(port)]
            procs.append(subprocess.Popen([*run, *app[1:], *args], cwd=cwd, env=node_env, stderr=subprocess.PIPE))
            continue
        for local in range(per_node):  # srun: one task per process, its variables set by srun
            task = {
                "SLURM_JOB_ID": "4242",
                "SLURM_STEP_ID": "0",
                "SLURM_JOB_NAME": "seqmem",
                "SLURM_NTASKS": str(2 * per_node),
                "SLURM_NTASKS_PER_NODE": str(per_node),
                "SLURM_NNODES": "2",
                "SLURM_NODELIST": "127.0.0.1",
                "SLURM_NODEID": str(node),
                "SLURM_LOCALID": str(local),
                "SLURM_PROCID": str(node * per_node + local),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            procs.append(subprocess.Popen([*app, *args], cwd=cwd, env={**node_env, **task}, stderr=subprocess.PIPE))
    return procs


@pytest.mark.slow
@pytest.mark.parametrize(
    "launcher, per_node, caches",
    [("torchrun", 1, "node-local"), ("srun", 2, "shared")],
)
def test_two_nodes_write_one_run_folder_and_tokenize_as_documented(tmp_path, launcher, per_node, caches):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(textwrap.dedent(NOTE_TOKENIZING))
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " + "word " * (3 + i % 11)}) + "\n" for i in range(64)))
    notes = tmp_path / "notes"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(hooks), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "SEQMEM_TEST_NOTES": str(notes),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("SLURM_JOB_ID", None)
    cache = {n: tmp_path / (f"cache-node{n}" if caches == "node-local" else "cache") for n in (0, 1)}
    overrides = {n: ([f"data.dataset={data}", f"data.cache_dir={cache[n]}"], {}) for n in (0, 1)}
    procs = _launch(launcher, per_node, free_port(), env, tmp_path, overrides)
    deadline, errors = time.monotonic() + 240, []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"the job did not finish in 240 s: {proc.args}")
        if proc.returncode:
            errors.append(err.decode()[-3000:])
    assert not errors, "\n\n".join(errors)

    [status] = list((tmp_path / "outputs").rglob("job_status.json"))  # one folder, written by rank zero only
    run = status.parent
    assert json.loads(status.read_text())["status"] == "finished"
    assert [p.parent for p in (tmp_path / "outputs").rglob("summary.json")] == [run]
    assert run.name == ("slurm-4242" if launcher == "srun" else run.name) and (run / ".hydra").is_dir()
    written = [line.split() for line in notes.read_text().splitlines()]  # (node, split) per tokenization
    splits = sorted({split for _, split in written})
    if caches == "node-local":  # each node's first process tokenizes each split, once
        assert sorted(written) == sorted([node, split] for node in "01" for split in splits)
    else:  # a shared cache: one process of the whole job tokenizes, the others wait and read its entry
        assert sorted(split for _, split in written) == splits
