"""seqmem-train on two simulated nodes of one machine, launched by the shipped examples: two
``examples/torchrun_nodes.sh`` side by side (``torchrun --nnodes 2 --node_rank 0|1`` on 127.0.0.1), and
``examples/multinode.sbatch`` run as ``sbatch`` runs it, with a stand-in ``srun`` that starts the tasks with the
variables ``srun`` sets. Gloo on the CPU.

The job writes one run folder (one ``job_status.json``, one ``summary.json``), and tokenizes each split once per
node with node-local caches and once for the whole job with a shared one (the entry lock, docs/many_machines.md).
Who tokenized is told by a ``sitecustomize`` on the children's path that notes each tokenization in a file.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _forked_ranks import free_port
from _site_hook import site_hook_path

from lightning_seqmem.data.cache_dir import default_cache_dir

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TINY = [
    "trainer=cpu",
    "trainer.strategy=ddp",
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
    node = os.environ.get("SEQMEM_TEST_NODE", os.environ.get("SLURM_NODEID"))
    with open(os.environ["SEQMEM_TEST_NOTES"], "a") as f:
        f.write(f"{node} {job.split}\\n")
    return _real(ds, job, procs)

token_cache._tokenize_split = _noted
"""

# What srun does inside an sbatch job, for this test: one task per process of each node, with srun's variables, and
# its exit status the first failing task's. The tasks are forked from this stand-in once it has imported the console
# script (a fresh interpreter per task costs ~9 CPU-s of imports); each then runs as the script does, from
# ``sys.exit(main())`` to the interpreter's exit. The torchrun case starts every rank as a fresh interpreter.
SRUN = """#!{python}
import gc, os, sys
gc.disable()  # until what the tasks share is imported, then frozen (as before a fork: no pass copies its pages)
from importlib.metadata import entry_points
command = [a for a in sys.argv[1:] if not a.startswith("--")]
[script] = entry_points(group="console_scripts", name=command[0])
main = script.load()
sys.path.insert(0, {tests!r})
from _job_imports import import_job_modules
import_job_modules()  # what every task imports, once
sys.path.pop(0)
gc.freeze()
gc.enable()
nodes, per_node = int(os.environ["SLURM_NNODES"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
tasks = []
for node in range(nodes):
    for local in range(per_node):
        pid = os.fork()
        if pid == 0:
            ids = {{"SLURM_NODEID": node, "SLURM_LOCALID": local, "SLURM_PROCID": node * per_node + local}}
            os.environ.update({{"SLURM_STEP_ID": "0", **{{k: str(v) for k, v in ids.items()}}}})
            sys.argv = command
            sys.exit(main())
        tasks.append(pid)
codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in tasks]
sys.exit(next((1 if code < 0 else code for code in codes if code), 0))
"""


def _launch(launcher: str, per_node: int, tmp_path: Path, env: dict, args: list) -> list:
    """Each node's launcher, started side by side (torchrun), or the batch script (sbatch)."""
    port = str(free_port())
    if launcher == "torchrun":
        run = {**env, "NODES": "2", "PROCS": str(per_node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        run |= {"TRAINER": "cpu", "TORCHRUN": f"{sys.executable} -m torch.distributed.run"}
        return [
            subprocess.Popen(
                ["bash", str(EXAMPLES / "torchrun_nodes.sh"), *args, f"data.cache_dir={tmp_path}/cache-node{node}"],
                cwd=tmp_path,
                env={**run, "NODE_RANK": str(node), "SEQMEM_TEST_NODE": str(node)},
                stderr=subprocess.PIPE,
                start_new_session=True,  # its ranks in its group: all killed together if the test times out
            )
            for node in (0, 1)
        ]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN.format(python=sys.executable, tests=str(Path(__file__).parent)))
    (bin_dir / "srun").chmod(0o755)
    job = {  # what sbatch sets for the batch script (--nodes=2 --ntasks-per-node=N)
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "seqmem-train",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS_PER_NODE": str(per_node),
        "SLURM_NTASKS": str(2 * per_node),
        "SLURM_NODELIST": "127.0.0.1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "SHARED": str(tmp_path),
        "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env["PATH"]]),
    }
    script = ["bash", str(EXAMPLES / "multinode.sbatch"), *args]
    return [subprocess.Popen(script, cwd=tmp_path, env={**env, **job}, stderr=subprocess.PIPE, start_new_session=True)]


@pytest.mark.slow
@pytest.mark.parametrize("launcher, per_node, caches", [("torchrun", 1, "node-local"), ("srun", 2, "shared")])
def test_two_nodes_write_one_run_folder_and_tokenize_as_documented(tmp_path, launcher, per_node, caches):
    hooks = site_hook_path(tmp_path / "hooks", textwrap.dedent(NOTE_TOKENIZING))
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " + "word " * (3 + i % 11)}) + "\n" for i in range(64)))
    notes = tmp_path / "notes"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    # The built-in corpus and tokenizer where this session built them, as a cluster's user cache holds them after a
    # first job: multinode.sbatch keeps a set XDG_CACHE_HOME, and building them again (~7 CPU-s per cache, on each
    # node's first rank while the others wait) is not what this test is about; the token cache stays in tmp_path.
    env["XDG_CACHE_HOME"] = str(default_cache_dir().parent)
    env |= {
        "PYTHONPATH": hooks,
        "SEQMEM_TEST_NOTES": str(notes),
        "OMP_NUM_THREADS": "1",
    }
    procs = _launch(launcher, per_node, tmp_path, env, [*TINY, f"data.dataset={data}"])
    deadline, errors = time.monotonic() + 300, []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            pytest.fail(f"the job did not finish in 300 s: {proc.args}")
        if proc.returncode:
            errors.append(err.decode()[-3000:])
    assert not errors, "\n\n".join(errors)

    [status] = list((tmp_path / "outputs").rglob("job_status.json"))  # one folder, written by rank zero only
    run = status.parent
    assert json.loads(status.read_text())["status"] == "finished" and (run / ".hydra").is_dir()
    assert [p.parent for p in (tmp_path / "outputs").rglob("summary.json")] == [run]
    if launcher == "srun":
        assert run == tmp_path / "outputs" / "slurm-4242"  # the job's id names it on every node
    written = [line.split() for line in notes.read_text().splitlines()]  # (node, split) per tokenization
    splits = sorted({split for _, split in written})
    if caches == "node-local":  # each node's first process tokenizes each split, once
        assert sorted(written) == sorted([node, split] for node in "01" for split in splits)
    else:  # a shared cache: one process of the whole job tokenizes, the others wait and read its entry
        assert sorted(split for _, split in written) == splits
