"""A run preempted twice, as a user meets it: ``seqmem-train`` in a process of its own stopped with real signals
(SIGINT, then SIGKILL) and resumed from the command line into the same folder, the files it leaves read back. One
chain of three processes answers every assertion (each is a separate test over the shared chain)."""

import csv
import json
import os
import re
import shlex
import signal
import time

import pytest

pytestmark = pytest.mark.xdist_group(
    "stop_resume"
)  # one chain of runs: keep its tests on one worker (--dist loadgroup)

SHRINK = [
    "trainer.max_steps=6",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "data.max_length=64",
    "~callbacks.preallocate",
]


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def start(args, cwd):
    """``seqmem-train <args>`` as a shell starts it, in a process forked from this one (its imports paid once):
    signals reach the app's own handlers; the console script itself runs in test_train."""
    from _forked_app import start_forked_main

    from lightning_seqmem.apps.train import main

    return start_forked_main(main, ["seqmem-train", *args], cwd)


def stop_at(proc, run_dir, step, signum, timeout=240):
    """Send ``signum`` once train_progress.csv has the row of ``step``; the process's exit status and output."""
    deadline = time.monotonic() + timeout
    path = run_dir / "train_progress.csv"
    while not (path.exists() and any(int(r["step"]) >= step for r in read_csv(path))):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the step"
        time.sleep(0.1)
    proc.send_signal(signum)
    done = proc.wait(timeout=120)
    return done.returncode, done.stdout + done.stderr


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Run A: checkpoints every 2 steps, Ctrl-C (SIGINT) after step 3. Run B: the resume command A printed, less
    checkpoint_every_n_steps, SIGKILL after step 5. Run C: ``ckpt_path=last`` in the same folder, to the end."""
    root = tmp_path_factory.mktemp("chain")
    run_dir = root / "run"
    out = {"dir": run_dir}
    proc = start([*SHRINK, "checkpoint_every_n_steps=2", f"hydra.run.dir={run_dir}"], root)
    out["a_rc"], out["a_log"] = stop_at(proc, run_dir, 3, signal.SIGINT)
    out["a_status"] = json.load(open(run_dir / "job_status.json"))
    out["a_files"] = sorted(os.listdir(run_dir / "checkpoints"))
    out["a_inodes"] = {n: os.stat(run_dir / "checkpoints" / n).st_ino for n in out["a_files"]}
    out["a_train_rows"] = read_csv(run_dir / "train_progress.csv")
    command = re.search(r"resume: (.+)", out["a_log"])
    out["command"] = command and command[1]
    # As the README writes it: without checkpoint_every_n_steps (the printed command keeps it)
    args = [a for a in shlex.split(out["command"] or "seqmem-train") if not a.startswith("checkpoint_every")]
    proc = start(args[1:], root)
    out["b_rc"], out["b_log"] = stop_at(proc, run_dir, 5, signal.SIGKILL)
    done = start([*SHRINK, "ckpt_path=last", f"hydra.run.dir={run_dir}"], root).wait(timeout=300)
    out["c_rc"], out["c_log"] = done.returncode, done.stdout + done.stderr
    return out


@pytest.mark.slow
def test_a_stop_says_where_to_resume_from(chain):
    """Ctrl-C: status "interrupted" (not "failed"), exit 130, and the last checkpoint and the command to resume."""
    assert chain["a_rc"] == 130, chain["a_log"][-3000:]
    assert chain["a_status"] == {"status": "interrupted", "signal": "SIGINT"}
    last = str(chain["dir"] / "checkpoints" / "last.ckpt")
    assert f"stopped by SIGINT: last checkpoint {last} (step 2)" in chain["a_log"]
    assert chain["command"].endswith(f"ckpt_path={last}") and f"hydra.run.dir={chain['dir']}" in chain["command"]


@pytest.mark.slow
def test_each_checkpoint_is_written_once(chain):
    """``last.ckpt`` is the step's checkpoint itself (one inode, one write), and nothing half-written is left."""
    assert chain["a_files"] == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert chain["a_inodes"]["last.ckpt"] == chain["a_inodes"]["epoch=0-step=2.ckpt"]


@pytest.mark.slow
def test_the_resumed_run_says_where_it_goes_on_and_keeps_saving(chain):
    """The resume line names the checkpoint, step, epoch and data position; without checkpoint_every_n_steps the
    resumed run keeps the checkpoint's interval, so the SIGKILL after step 5 leaves step 4 to resume from."""
    line = r"resuming from \S+last\.ckpt: step 2, epoch 0, \d batches of epoch 0 read; checkpoints every 2 steps as"
    assert re.search(line, chain["b_log"]), chain["b_log"][:3000]
    assert chain["b_rc"] == -signal.SIGKILL
    assert re.search(r"resuming from \S+last\.ckpt: step 4, epoch 0", chain["c_log"]), chain["c_log"][-3000:]
    assert chain["c_rc"] == 0 and json.load(open(chain["dir"] / "job_status.json")) == {"status": "finished"}
    assert "exists and is not empty" not in chain["b_log"] + chain["c_log"]  # its own checkpoints, no warning
    assert sorted(os.listdir(chain["dir"] / "checkpoints")) == ["epoch=0-step=6.ckpt", "last.ckpt"]


@pytest.mark.slow
def test_the_whole_run_is_reported(chain):
    """The files of the folder the run was resumed into: every step once, tokens and clocks only going up; the
    summary counts the whole run's tokens (the last row's), and this process's part "since resume"."""
    run_dir = chain["dir"]
    rows = read_csv(run_dir / "train_progress.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    for key in ("tokens_seen", "wall_clock_s", "cpu_s"):
        values = [float(r[key]) for r in rows]
        assert all(a < b for a, b in zip(values, values[1:])), (key, values)
    assert rows[:2] == chain["a_train_rows"][:2]  # the rows up to the first checkpoint stay as written
    val = read_csv(run_dir / "progress.csv")
    assert [int(r["step"]) for r in val] == [2, 4, 6]
    assert all(float(a["tokens_seen"]) < float(b["tokens_seen"]) for a, b in zip(val, val[1:]))
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["real_tokens_trained"] == int(rows[-1]["tokens_seen"])
    assert summary["resumed_at_step"] == 4 and summary["optimizer_steps_since_resume"] == 2
    tokens_at_4 = int(next(r for r in rows if r["step"] == "4")["tokens_seen"])
    assert summary["real_tokens_trained_since_resume"] == summary["real_tokens_trained"] - tokens_at_4
    assert summary["wall_clock_s"] > summary["wall_clock_s_since_resume"]


@pytest.fixture(scope="module")
def changed(chain, tmp_path_factory):
    """The finished chain's checkpoint resumed with another ``max_length`` and ``max_steps`` (run D, refused), then
    with the way out its message gives, as typed (run E)."""
    from _forked_app import run_forked_main

    from lightning_seqmem.apps.train import main

    # forked from this process (its imports done): these two runs test what the app says, not how it was started
    root = tmp_path_factory.mktemp("changed")
    last = chain["dir"] / "checkpoints" / "last.ckpt"
    base = ["seqmem-train", *SHRINK, "trainer.max_steps=8", "data.max_length=48", f"ckpt_path={last}"]
    d = run_forked_main(main, [*base, f"hydra.run.dir={root / 'd'}"], root)
    fix = re.search(r"data\.on_resume_mismatch=\S+?(?=[\s,;)]|$)", d.stderr)
    e_args = [*base, f"hydra.run.dir={root / 'e'}", fix[0] if fix else "data.on_resume_mismatch=restart_epoch"]
    e = run_forked_main(main, e_args, root)
    return {"d": d, "fix": fix and fix[0], "e": e, "e_dir": root / "e"}


@pytest.mark.slow
def test_other_data_settings_are_refused_with_the_way_out_as_typed(changed):
    """The refusal is one message whose way out is spelt for the command line (``data.on_resume_mismatch=...``, a
    key of the data config: no ``+``), and that spelling, typed, resumes; another max_steps is warned about."""
    d, e = changed["d"], changed["e"]
    assert d.returncode == 1 and "Traceback" not in d.stderr, d.stderr[-3000:]
    assert changed["fix"] and "restart_epoch" in changed["fix"], d.stderr[-3000:]
    assert "on_resume_mismatch='restart_epoch'" not in d.stderr.replace(changed["fix"], "")  # no Python spelling
    assert "trainer.max_steps=8 is not the checkpoint's (6)" in d.stdout + d.stderr
    assert e.returncode == 0, e.stderr[-3000:]
    summary = json.load(open(changed["e_dir"] / "summary.json"))
    assert summary["optimizer_steps"] == 8 and summary["resumed_at_step"] == 6
