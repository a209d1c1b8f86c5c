"""Rank zero and the job's one run folder, read from each launcher's variables as it sets them; the trainer keys
that say N nodes (``trainer.num_nodes``, ``trainer.prepare_data_per_node``) given without ``+``."""

import pytest

from lightning_seqmem.apps.cluster import global_rank, is_rank_zero, job_id, launched_processes, run_dir_overrides

TORCHRUN = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job7", "WORLD_SIZE": "4"}


def _srun(procid: int, nodeid: int, localid: int, name: str = "train") -> dict:
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NAME": name,
        "SLURM_NTASKS": "4",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_PROCID": str(procid),
        "SLURM_NODEID": str(nodeid),
        "SLURM_LOCALID": str(localid),
    }


# (what launched the process, its variables, its rank, the job's name, processes the launcher started)
LAUNCHES = [
    ("one process", {}, 0, None, 1),
    (
        "torchrun node 1, local 0",
        {**TORCHRUN, "RANK": "2", "LOCAL_RANK": "0", "GROUP_RANK": "1"},
        2,
        "torchrun-job7",
        4,
    ),
    (
        "torchrun node 0, local 0",
        {**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"},
        0,
        "torchrun-job7",
        4,
    ),
    ("torchrun, no --rdzv-id", {**TORCHRUN, "TORCHELASTIC_RUN_ID": "none", "RANK": "1", "LOCAL_RANK": "1"}, 1, None, 4),
    ("srun task 1 of node 0", _srun(1, 0, 1), 1, "slurm-4242", 4),  # neither LOCAL_RANK nor NODE_RANK is set
    ("srun task 2 of node 1", _srun(2, 1, 0), 2, "slurm-4242", 4),
    ("srun task 0", _srun(0, 0, 0), 0, "slurm-4242", 4),
    ("Lightning's child on node 0", {"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"}, 1, None, 1),
    ("Lightning's first process of node 1", {"LOCAL_RANK": "0", "NODE_RANK": "1"}, 1000, None, 1),
    # an interactive SLURM shell: SLURM_PROCID is the shell's, Lightning launched the ranks (as Lightning reads it)
    ("salloc shell, Lightning's child", {**_srun(0, 0, 0, name="bash"), "LOCAL_RANK": "1"}, 1, None, 1),
]


@pytest.mark.parametrize("launch, env, rank, name, processes", LAUNCHES, ids=[row[0] for row in LAUNCHES])
def test_rank_job_and_folder_from_each_launcher(launch, env, rank, name, processes):
    assert (global_rank(env), is_rank_zero(env), job_id(env), launched_processes(env)) == (
        rank,
        rank == 0,
        name,
        processes,
    )
    given = ["trainer.max_steps=2"]
    overrides = run_dir_overrides(given, env)
    if processes == 1:
        assert overrides == given  # Lightning's own launcher passes its children the folder itself
        return
    folder = [o for o in overrides if o.startswith("hydra.run.dir=")]
    assert folder == ([f"hydra.run.dir=outputs/{name}"] if name else [])
    others = ["hydra.output_subdir=null", f"hydra.job.name=seqmem-train_rank{rank}"]
    assert overrides[-2:] == others if rank else not set(others) & set(overrides)
    assert run_dir_overrides([*given, "hydra.run.dir=mine"], env)[:2] == [*given, "hydra.run.dir=mine"]
    assert run_dir_overrides(["-m", *given], env) == ["-m", *given]  # a sweep names its own folders


def test_trainer_keys_for_many_nodes_need_no_plus(capsys):
    """``trainer.num_nodes=2``, ``trainer.strategy=ddp``, ``trainer.prepare_data_per_node=false`` are keys of every
    trainer option; the Trainer is built without the DataModule's key (the app sets it on the DataModule)."""
    from hydra import compose, initialize_config_module

    from lightning_seqmem.apps.overrides import exit_on_unknown_override
    from lightning_seqmem.apps.train import build_datamodule, trainer_config

    given = ["trainer=cpu", "trainer.num_nodes=2", "trainer.strategy=ddp", "trainer.prepare_data_per_node=false"]
    exit_on_unknown_override(given, "config")  # would exit, asking for +
    with initialize_config_module("lightning_seqmem.conf", version_base="1.3"):
        cfg = compose("config", overrides=[*given, "trainer.default_root_dir=."])
        other = compose("config", overrides=["trainer=ddp"])  # over gpu, over cpu: every option has the keys
        assert other.trainer.num_nodes == 1 and other.trainer.prepare_data_per_node is True
    assert cfg.trainer.num_nodes == 2 and cfg.trainer.prepare_data_per_node is False
    built = trainer_config(cfg)
    assert "prepare_data_per_node" not in built and cfg.trainer.prepare_data_per_node is False
    assert built.num_nodes == 2 and built.default_root_dir == "."  # the rest as composed
    assert build_datamodule(cfg).prepare_data_per_node is False  # Lightning reads it from the DataModule
