"""Every example runs, shortened (example 2, the warmup sweep, runs in tests/test_sweep.py).

The Python examples run as ``__main__`` inside the test process (``runpy``), with their own command-line arguments:
the same script, without paying a fresh interpreter and its imports each time. ``streaming.py`` runs as a real
``python examples/streaming.py`` process, so one example is checked the way a user starts it (its loader workers
fork from a small process, not from pytest)."""

import pathlib
import runpy
import sys

import pytest
import yaml

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
ALLOCATOR_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")

pytestmark = pytest.mark.slow  # each example trains end to end

# One optimizer step each: the examples set val_check_interval=max(1, max_steps // 2), so 3 steps validated three
# times; with 1 the run validates once, at its end. What is checked (the first batch, the data's statistics, a final
# validation loss, the summary) does not depend on how many steps ran.


@pytest.fixture()
def run_example(tmp_path, monkeypatch, capfd):
    """Run ``examples/<script>`` as ``__main__`` with ``args`` in ``tmp_path``; return what it printed."""

    def run(script, *args):
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sys, "argv", [str(EXAMPLES / script), *args])
        for name in ALLOCATOR_VARS:  # the example's configure_allocator() sets one: undone after the test
            monkeypatch.setenv(name, "")
            monkeypatch.delenv(name)
        runpy.run_path(str(EXAMPLES / script), run_name="__main__")
        return capfd.readouterr().out

    return run


def run_example_process(script, *args, cwd):
    """``python examples/<script> <args>`` with its output to pipes, in a process of its own forked from this one
    (its imports paid once; its loader workers are forked from it as from a fresh script)."""
    from _forked_app import run_forked_main

    path = str(EXAMPLES / script)

    def main():
        runpy.run_path(path, run_name="__main__")

    proc = run_forked_main(main, [path, *args], cwd, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_own_trainer(tmp_path, run_example):
    out = run_example("own_trainer.py", "--max-steps", "1", "--max-length", "64", "--out", str(tmp_path / "run"))
    assert "optimizer_steps" in out and "pack" in out  # RunSummary's table
    assert (tmp_path / "run" / "summary.json").exists()


def test_sft_packing_completion_only_loss(tmp_path, run_example):
    out = run_example("sft_packing.py", "--max-steps", "1", "--out", str(tmp_path / "run"))
    line = next(l for l in out.splitlines() if l.startswith("first batch"))
    segments = int(line.split(": ")[1].split(" segments")[0])
    trained, total = (int(x) for x in line.split("segments, ")[1].split(" tokens")[0].split(" of "))
    assert segments > 8  # several examples per row
    assert 0 < trained < total / 4  # loss only on the short completions
    assert "final_val_loss" in out


def test_chat_sft_trains_on_assistant_turns(tmp_path, run_example):
    out = run_example("chat_sft.py", "--max-steps", "1", "--out", str(tmp_path / "run"))
    stats = next(l for l in out.splitlines() if l.startswith("conversations:"))
    assert "mask from generation_markers" in stats
    share = float(stats.split(", ")[2].split("%")[0])
    assert 0 < share < 100  # the user turns and headers carry no loss
    batch = next(l for l in out.splitlines() if l.startswith("first batch"))
    assert int(batch.split(": ")[1].split(" segments")[0]) > 8  # whole conversations packed together
    assert "Mixing" in batch and "</s>" in batch  # the assistant's answer and the EOS closing its turn
    assert "final_val_loss" in out


def test_cli_yaml(tmp_path, monkeypatch):
    from lightning_seqmem.apps.cli import cli_main

    config = yaml.safe_load(open(EXAMPLES / "cli.yaml"))
    config["trainer"].update(
        max_steps=3,
        val_check_interval=3,
        limit_val_batches=2,
        accelerator="cpu",
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
    )
    config["data"]["init_args"]["max_length"] = 64
    config["trainer"]["callbacks"][0]["init_args"]["max_seq_length"] = 64
    path = tmp_path / "cli.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setattr(sys, "argv", ["seqmem-cli"])
    cli = cli_main(["fit", "--config", str(path)])
    assert cli.trainer.global_step == 3
    assert [type(cb).__name__ for cb in cli.trainer.callbacks][:6] == [
        "SeqLengthWarmup",
        "CachePreallocator",
        "MemoryMonitor",
        "ConfigChecks",
        "RunSummary",
        "JobRecord",
    ]
    assert (tmp_path / "progress.csv").exists() and (tmp_path / "summary.json").exists()


def test_dpo_pairs(tmp_path, run_example):
    out = run_example("dpo.py", "--max-steps", "1", "--max-length", "64", "--out", str(tmp_path / "run"))
    line = next(l for l in out.splitlines() if l.startswith("first batch"))
    assert "sequence_index" in line and "completion_mask" in line  # packed pairs
    assert "final_val_loss" in out and "val/reward_accuracy" in out


# its pairs' template writes the prompt's end differently before a completion: said once, as it should be
@pytest.mark.filterwarnings("ignore:Pairs \\[\\d+\\]. the prompt rendered with the generation prompt is not a prefix")
def test_dpo_conversation_pairs(tmp_path, run_example):
    out = run_example(
        "dpo.py",
        "--max-steps",
        "1",
        "--max-length",
        "64",
        "--chat",
        "--strategy",
        "pad",
        "--out",
        str(tmp_path / "run"),
    )
    line = next(l for l in out.splitlines() if l.startswith("first batch"))
    assert "completion_mask" in line and "pairs" in line
    assert "val/reward_accuracy" in out


def test_streaming_example_reads_its_files_as_a_stream(tmp_path):
    out = run_example_process("streaming.py", "--max-steps", "1", "--out", str(tmp_path / "run"), cwd=tmp_path)
    line = next(l for l in out.splitlines() if l.startswith("stream read so far"))
    documents = int(line.split(": ")[1].split(" documents")[0].replace(",", ""))
    assert 0 < documents <= 2000 - 64 and "final_val_loss" in out
    # Its output to a pipe: the step bar's plain lines (optimizer steps of max_steps), not Rich's "Epoch 0/-2".
    assert "step 1/1 (100%)" in out and "Epoch 0/" not in out and "\r" not in out and "\x1b[" not in out


def test_dpo_defaults_keep_the_training_tokens(tmp_path, run_example, monkeypatch):
    """With its defaults the DPO example trained on 52 % of its tokens (the rest cut off a long tail of answers):
    now the pairs that do not fit are left out, counted, and nothing is cut. The data only: fit is not run."""
    import lightning.pytorch as L

    monkeypatch.setattr(L.Trainer, "fit", lambda self, *args, **kwargs: None)
    out = run_example("dpo.py", "--out", str(tmp_path / "run"))
    left = next(l for l in out.splitlines() if l.startswith("pairs longer than max_length=384 left out"))
    left_out, total = (int(x) for x in left.split("train ")[1].split(",")[0].split(" of "))
    assert left_out <= 0.06 * total  # 295 of 6,155
    line = next(l for l in out.splitlines() if l.startswith("first batch"))
    lost, tokens = (int(x.replace(",", "")) for x in line.split("pairs, ")[1].split(" tokens")[0].split(" of "))
    assert lost <= 0.01 * tokens  # was 48 % at the old max_length=128
