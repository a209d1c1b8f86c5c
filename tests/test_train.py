"""seqmem-train: a shrunk job through compose + train() in-process, a failing one through main() in a forked process,
and one real run of the console script."""

import csv
import json
import os
import re
import subprocess
import sys

import pytest
from _forked_app import run_forked_main
from _gc_at_exit import noting_env, read_note
from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

# Small enough for a 2-core CPU: a few steps of 8 x 64 tokens, two validation batches.
SHRINK = [
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "+trainer.enable_progress_bar=false",
    "+trainer.enable_model_summary=false",
    "data.max_length=64",
    "print_summary=false",
]


def run_in_process(tmp_path, overrides=()):
    """Compose like the app does, point the run directory at tmp_path, and train."""
    from lightning_seqmem.apps.train import train

    with initialize_config_module("lightning_seqmem.conf", version_base="1.3"):
        cfg = compose("config", overrides=SHRINK + list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(tmp_path)
        cfg.hydra.job.num = 0
    HydraConfig.instance().set_config(cfg)
    return train(cfg)


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_console_script_run(tmp_path):
    """The real `seqmem-train` in a subprocess, other group options picked on the command line, progress bar on:
    each log line once, the bar counts steps out of max_steps, no upstream deprecation noise, a final validation;
    the files of the run (summary, progress against time and tokens, the logger's metrics with the warmup's
    length). One run answers all of these; the in-process runs below vary the data."""
    run_dir = tmp_path / "run"
    shrink = [o for o in SHRINK if not o.startswith(("+trainer.enable_progress_bar", "trainer.max_steps", "print_"))]
    cmd = [
        sys.executable,
        "-m",
        "lightning_seqmem.apps.train",
        *shrink,
        "trainer.max_steps=5",
        "callbacks.seq_warmup.duration=0.5",
        "model=tiny_gpt2",
        "batching=pack_bfd",
        "logger=[csv,tensorboard]",
        "~callbacks.preallocate",
        f"hydra.run.dir={run_dir}",
    ]
    env, gc_note = noting_env(tmp_path)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.load(open(run_dir / "job_status.json")) == {"status": "finished"}
    # Its imports ran without full collections, and its exit leaves the collector nothing to walk (short_process):
    # before, 8 full passes and over half a million objects walked again in the teardown.
    gc_at_exit = read_note(gc_note)
    assert gc_at_exit.walked < 1000 < gc_at_exit.frozen and gc_at_exit.full_collections <= 3, gc_at_exit
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["strategy"].startswith("pack") and summary["optimizer_steps"] == 5
    assert summary["final_val_loss"] > 0
    progress = read_csv(run_dir / "progress.csv")
    assert [int(r["step"]) for r in progress] == [2, 4, 5]  # 5: the final validation
    tokens = [int(r["tokens_seen"]) for r in progress]
    assert 0 < tokens[0] < tokens[1] < tokens[2]
    assert all(float(r["wall_clock_s"]) <= float(r["elapsed_s"]) for r in progress)
    metrics = read_csv(run_dir / "csv" / "version_0" / "metrics.csv")
    seq_lens = [float(r["seq_length_warmup/seq_len"]) for r in metrics if r.get("seq_length_warmup/seq_len")]
    assert seq_lens and seq_lens[0] < 64 and seq_lens[-1] == 64  # warmup grew the length to max_length
    assert any(r.get("val/loss") for r in metrics) and any(r.get("train/loss") for r in metrics)
    assert [int(r["step"]) for r in read_csv(run_dir / "train_progress.csv")] == [1, 2, 3, 4, 5]
    assert os.listdir(run_dir / "tensorboard" / "version_0")
    assert (run_dir / ".hydra" / "overrides.yaml").exists()
    assert not (tmp_path / "outputs").exists()

    output = proc.stdout + proc.stderr
    lines = [line.strip() for line in output.replace("\r", "\n").splitlines()]
    logged = [line.split("] - ", 1)[1] for line in lines if "][INFO] - " in line]
    assert any(m.startswith("Seed set to") for m in logged)
    assert len(logged) == len(set(logged)), "a log line printed twice"
    assert not [line for line in lines if line.startswith("INFO: ")]  # Lightning's own handler is gone
    # Output to a pipe, as under SLURM or nohup: plain lines, no carriage return, no escape code, and the summary.
    assert "\r" not in output and "\x1b[" not in output
    assert re.search(r"step 5/5 \(100%\), epoch 0, [0-9.]+ s/step, elapsed 0:00:\d\d, left 0:00:00", output)
    assert re.search(r"validation at step 2: 2 batches in [0-9.]+ s, val/loss=", output)
    assert (
        re.search(r"\nreal_token_fraction +1\.0000\n", proc.stdout)
        and "final_val_loss" in proc.stdout.split("step 5/5")[-1]
    )
    for noise in ("set_vital", "LeafSpec", "Tip:", "litlogger"):
        assert noise not in output
    assert "Epoch 0/-2" not in output


@pytest.mark.parametrize("option", ["local", "hf"])
def test_data_option_without_dataset_fails_clearly(tmp_path, option):
    with pytest.raises(
        ValueError, match=f"data.dataset is required with data={option}: .*seqmem-train data={option} data.dataset="
    ):
        run_in_process(tmp_path, [f"data={option}"])
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.slow
def test_data_local_trains_on_the_given_file(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " + "words " * (i % 9)}) + "\n" for i in range(60)))
    summary = run_in_process(
        tmp_path,
        [
            "data=local",
            f"data.dataset={data}",
            "trainer.max_steps=2",
            "trainer.val_check_interval=2",
            "~callbacks.preallocate",
        ],
    )
    assert summary["optimizer_steps"] == 2 and summary["final_val_loss"] > 0


@pytest.mark.slow
def test_main_job_streams_the_builtin_corpus(tmp_path):
    """``data.streaming=true``: the main job trains on the corpus as a stream and reports what it read."""
    summary = run_in_process(tmp_path, ["batching=pack_bfd", "data.streaming=true"])
    assert summary["optimizer_steps"] == 4 and summary["final_val_loss"] > 0
    assert summary["real_token_fraction"] > 0.9 and summary["dataset_documents_split"] > 0


@pytest.mark.slow
def test_bad_input_fails_clearly_and_records_it(tmp_path):
    """seqmem-train's main() in a process of its own (forked from this one: no fresh imports); the console script
    itself runs in test_console_script_run."""
    from lightning_seqmem.apps.train import main

    run_dir = tmp_path / "run"
    argv = ["seqmem-train", "data.max_length=1", f"hydra.run.dir={run_dir}"]
    proc = run_forked_main(main, argv, cwd=tmp_path)
    assert proc.returncode != 0
    assert "max_length must be an int >= 2" in proc.stderr
    status = json.load(open(run_dir / "job_status.json"))
    assert status["status"] == "failed" and "max_length" in status["error"]


@pytest.mark.slow
def test_unknown_group_option_lists_valid_ones(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_seqmem.apps.train", "trainer=tpu", f"hydra.run.dir={tmp_path}/run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert (
        "Unknown option trainer=tpu: did you mean trainer=gpu? trainer's options: auto, cpu, ddp, ddp_spawn, gpu."
        in proc.stderr
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lightning_seqmem.apps.train", "lightning_seqmem.apps.cli"])
def test_allocator_configured_before_torch(name):
    """Every entry point's ``main`` sets the allocator settings (``memory.allocator.configure_allocator``, the one
    function both call) before anything imports torch: a finder stops the process at torch's first import and
    exits 0 only when the settings are in the environment by then (3: they are not; 4: torch was never imported)."""
    code = (
        "import importlib, os, sys\n"
        "class StopAtTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n"
        "            conf = os.environ.get('PYTORCH_ALLOC_CONF') or os.environ.get('PYTORCH_CUDA_ALLOC_CONF')\n"
        "            os._exit(0 if conf else 3)\n"
        "sys.meta_path.insert(0, StopAtTorch())\n"
        f"mod = importlib.import_module('{name}')\n"
        "sys.argv = [sys.argv[0]]\n"
        "mod.main()\n"
        "os._exit(4)\n"
    )
    env = {k: v for k, v in os.environ.items() if "ALLOC_CONF" not in k}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)


@pytest.mark.slow
def test_pretokenized_parquet_through_the_main_job(tmp_path, monkeypatch):
    """The issue's command line (``data=local data.dataset=pages.parquet data.tokenizer=null data.pad_token_id=0
    data.eos_token_id=102 model.vocab_size=30522``), composed and trained in-process: a parquet file of input_ids,
    no tokenizer, the special ids and the vocabulary given as data and model options only (the pad id's one owner
    is the data). The console script's own argument handling is what test_console_script_run runs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [[(7 * i + j) % 30000 + 103 for j in range(5 + i % 40)] for i in range(80)]
    pq.write_table(pa.table({"input_ids": rows}), tmp_path / "pages.parquet")
    monkeypatch.chdir(tmp_path)  # the relative path, as typed
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    summary = run_in_process(
        run_dir,
        [
            "data=local",
            "data.dataset=pages.parquet",
            "data.tokenizer=null",
            "data.pad_token_id=0",
            "data.eos_token_id=102",
            "model.vocab_size=30522",
            "trainer.max_steps=2",
            "~callbacks.preallocate",
        ],
    )
    assert summary["final_val_loss"] > 0 and json.load(open(run_dir / "summary.json"))["final_val_loss"] > 0
    hparams = (run_dir / "csv" / "version_0" / "hparams.yaml").read_text().splitlines()
    assert hparams.count("pad_token_id: 0") == 1 and "vocab_size: 30522" in hparams


def test_model_and_datamodule_log_no_key_both():
    """Lightning merges both sides' hparams into one log and refuses a key saved with two values: every fact has one
    owner (the pad id: the data; the vocabulary size: the model)."""
    from hydra.utils import instantiate

    with initialize_config_module("lightning_seqmem.conf", version_base="1.3"):
        cfg = compose("config", overrides=["data.pad_token_id=0", "data.eos_token_id=2", "model.vocab_size=64"])
    model, datamodule = instantiate(cfg.model), instantiate(cfg.data)
    assert not set(model.hparams_initial) & set(datamodule.hparams_initial)
    assert datamodule.hparams_initial["pad_token_id"] == 0 and model.hparams_initial["vocab_size"] == 64

    from lightning_seqmem import CausalLM

    told = CausalLM(model_config="tiny_llama", vocab_size=64, pad_token_id=5)  # the data's id wins, said once
    with pytest.warns(UserWarning, match=r"given pad_token_id=5 but the DataModule pads with 0; using 0"):
        told._take_pad_token_id(datamodule, None)
    assert told.hparams.pad_token_id == 0 and "pad_token_id" not in told.hparams_initial


@pytest.mark.parametrize("gpus", [0, 2])
def test_trainer_auto_follows_the_machine(monkeypatch, capsys, gpus):
    """trainer=auto (the default): cpu settings on a CPU; gpu settings, announced, where CUDA is visible. The GPU is
    simulated (the device count is what Lightning's accelerator="auto" asks too); an explicit option always wins."""
    import lightning.fabric.accelerators.cuda as cuda

    from lightning_seqmem.apps.train import choose_trainer

    monkeypatch.setattr(cuda, "num_cuda_devices", lambda: gpus)
    overrides = choose_trainer(["batching=pad"])
    line = capsys.readouterr().err
    assert choose_trainer(["trainer=cpu", "batching=pad"]) == ["trainer=cpu", "batching=pad"]
    assert choose_trainer(["trainer=ddp"]) == ["trainer=ddp"]
    with initialize_config_module("lightning_seqmem.conf", version_base="1.3"):
        chosen = compose("config", overrides=overrides).trainer
        cpu = compose("config", overrides=["trainer=cpu"]).trainer
        gpu = compose("config", overrides=["trainer=gpu"]).trainer
    if gpus:
        assert overrides == ["batching=pad", "trainer=gpu"] and chosen == gpu
        assert chosen.accelerator == "gpu" and chosen.precision.precision == "auto"
        assert "2 CUDA GPUs visible: training with trainer=gpu" in line and "trainer=cpu keeps the CPU" in line
    else:
        assert overrides == ["batching=pad"] and chosen == cpu and line == ""


@pytest.mark.slow
def test_sigterm_stops_a_multirun_at_once(tmp_path):
    """A real SIGTERM to a sweep in training: the job stops within seconds (Lightning alone waits for the end of
    the epoch, here the whole run, and the sweep then starts its next job), status 143, recorded as interrupted."""
    import signal
    import time

    sweep = tmp_path / "sweep"
    shrink = [o for o in SHRINK if not o.startswith(("trainer.max_steps", "trainer.val_check_interval"))]
    from _forked_app import start_forked_main

    from lightning_seqmem.apps.train import main

    argv = ["seqmem-train", "-m", *shrink, "trainer.max_steps=100000", "trainer.val_check_interval=100000"]
    argv += ["~callbacks.preallocate", "seed=1,2", f"hydra.sweep.dir={sweep}"]
    proc = start_forked_main(main, argv, tmp_path)  # a process of its own, its imports paid once
    try:
        deadline = time.monotonic() + 240
        while not (sweep / "0" / "train_progress.csv").exists():  # a row per step: the job is in fit
            assert proc.poll() is None and time.monotonic() < deadline, "the job ended before training"
            time.sleep(0.2)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        done = proc.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        proc.send_signal(signal.SIGKILL)
    # "at once" against the end of a 100,000-step run (hours): a bound a loaded 2-core machine cannot miss by chance
    assert done.returncode == 128 + signal.SIGTERM and took < 30, (done.returncode, took, done.stderr[-2000:])
    assert json.load(open(sweep / "0" / "job_status.json")) == {"status": "interrupted", "signal": "SIGTERM"}
    assert not (sweep / "1").exists()  # the sweep stopped: no next job


@pytest.mark.slow
def test_the_main_job_keeps_checkpoints_and_resumes_from_one(tmp_path):
    """``checkpoint_every_n_steps`` keeps ``<run dir>/checkpoints/last.ckpt``; ``ckpt_path=`` goes on from it (the
    stream's place included): the resumed job trains only the steps left."""
    stream = ["data.streaming=true"]
    first = run_in_process(tmp_path / "a", [*stream, "checkpoint_every_n_steps=2", "trainer.max_steps=2"])
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    assert first["optimizer_steps"] == 2 and last.exists()
    resumed = run_in_process(tmp_path / "b", [*stream, f"ckpt_path={last}"])
    assert resumed["optimizer_steps"] == 4 and resumed["resumed_at_step"] == 2
    # the whole run's tokens: the first process's, carried in the checkpoint, and this one's (as many: full rows)
    since = resumed["real_tokens_trained_since_resume"]
    assert (
        since == first["real_tokens_trained"] and resumed["real_tokens_trained"] == first["real_tokens_trained"] + since
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [["data=preference", "model=dpo", "data.max_prompt_length=32"], ["callbacks=none"]],
    ids=["readme_dpo", "callbacks_none"],
)
def test_a_piped_run_prints_what_it_does_and_nothing_false(tmp_path, overrides):
    """The README's ``data=preference model=dpo`` says nothing about tokens never trained on (warmup is off: it cuts
    nothing); ``callbacks=none`` still counts steps out of max_steps (not Lightning's ``Epoch 0/-2``); into a pipe
    no model-summary table."""
    from lightning_seqmem.apps.train import main

    shrink = [o for o in SHRINK if not o.startswith(("+trainer.enable_progress_bar", "+trainer.enable_model"))]
    argv = ["seqmem-train", *shrink, "trainer.max_steps=2", *overrides, f"hydra.run.dir={tmp_path / 'run'}"]
    proc = run_forked_main(main, argv, tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "never trained on" not in output and "SeqLengthWarmup" not in output
    assert "Epoch 0/-2" not in output and re.search(r"step 2/2 \(100%\)", output)
    assert "Trainable params" not in output and "Total params" not in output


@pytest.mark.slow
def test_seqmem_train_spells_a_fix_as_its_command_line_does(tmp_path, monkeypatch):
    """seqmem-train says it is the surface (its ranks inherit it): a message's fix reads ``data.<key>=<value>``."""
    from lightning_seqmem.apps import train as app
    from lightning_seqmem.messages import spell_data_option

    monkeypatch.setenv("LIGHTNING_SEQMEM_SURFACE", "python")
    monkeypatch.setattr(app, "train", lambda cfg: print(spell_data_option("on_resume_mismatch", "restart_epoch")) or {})
    proc = run_forked_main(app.main, ["seqmem-train", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 0 and "data.on_resume_mismatch=restart_epoch" in proc.stdout, proc.stderr[-2000:]
