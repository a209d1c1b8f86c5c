"""seqmem-cli (LightningCLI): callbacks added the Lightning way, --print_config round trip, subclasses, bad class
paths."""

import csv
import pathlib
import shlex
import subprocess
import sys
import textwrap

import pytest
from _gc_at_exit import noting_env, read_note

from lightning_seqmem.apps.cli import cli_main

SMALL = [
    "--trainer.max_steps=3",
    "--trainer.val_check_interval=3",
    "--trainer.limit_val_batches=2",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.accelerator=cpu",
    "--data.max_length=64",
]


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["seqmem-cli"])  # LightningCLI(args=...) warns when sys.argv has arguments


@pytest.mark.slow
def test_defaults_callbacks_plus_equals_and_print_config_round_trip(tmp_path, capsys):
    args = [
        "fit",
        *SMALL,
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks+=lightning_seqmem.SeqLengthWarmup",
        "--trainer.callbacks.duration=0.5",
        "--trainer.callbacks.max_seq_length=64",
        "--trainer.callbacks+=lightning_seqmem.apps.job_record.JobRecord",
    ]
    with pytest.raises(SystemExit) as done:
        cli_main(args + ["--print_config"])
    assert done.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "class_path: lightning_seqmem.CausalLM" in printed  # the default model, no --model needed
    assert "class_path: lightning_seqmem.SeqMemDataModule" in printed
    assert "duration: 0.5" in printed
    config = tmp_path / "printed.yaml"
    config.write_text(printed)

    cli = cli_main(["fit", "--config", str(config)])  # the printed config runs as it is
    assert cli.trainer.global_step == 3
    warmup = [cb for cb in cli.trainer.callbacks if type(cb).__name__ == "SeqLengthWarmup"]
    assert warmup and warmup[0].duration == 0.5 and warmup[0].tokens_seen > 0
    with open(tmp_path / "progress.csv") as f:
        assert [row["step"] for row in csv.DictReader(f)] == ["3"]


@pytest.mark.slow
def test_subclasses_replace_model_and_data(tmp_path, monkeypatch):
    (tmp_path / "my_classes.py").write_text(
        textwrap.dedent("""
        from lightning_seqmem import CausalLM, SeqMemDataModule

        class MyLM(CausalLM):
            def __init__(self, label: str = "mine", **kwargs):
                super().__init__(**kwargs)
                self.label = label

        class MyData(SeqMemDataModule):
            pass
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cli = cli_main(
        [
            "fit",
            *SMALL[:-1],
            f"--trainer.default_root_dir={tmp_path}",
            "--model=my_classes.MyLM",
            "--model.label=ours",
            "--model.model_config=tiny_gpt2",
            "--data=my_classes.MyData",
            "--data.max_length=64",
        ]
    )
    assert type(cli.model).__name__ == "MyLM" and cli.model.label == "ours"
    assert type(cli.datamodule).__name__ == "MyData"
    assert type(cli.model.model).__name__ == "GPT2LMHeadModel"
    assert cli.trainer.global_step == 3


@pytest.mark.parametrize(
    "args",
    [
        ["--model=lightning_seqmem.NoSuchModel"],
        ["--trainer.callbacks+=lightning_seqmem.NoSuchCallback"],
    ],
)
def test_bad_class_path_names_it(args, capsys):
    with pytest.raises(SystemExit) as err:
        cli_main(["fit", *args])
    assert err.value.code != 0
    assert args[0].split("=", 1)[1] in capsys.readouterr().err


@pytest.mark.slow
def test_bad_class_path_in_yaml_via_console_script(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("model:\n  class_path: my_missing_pkg.MyLM\n")
    env, gc_note = noting_env(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_seqmem.apps.cli", "fit", "--config", str(config)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "my_missing_pkg.MyLM" in proc.stderr and "No module named 'my_missing_pkg'" in proc.stderr
    # A mistake's exit too leaves the collector nothing to walk in the teardown (apps/short_process.py)
    gc_at_exit = read_note(gc_note)
    assert gc_at_exit.walked < 1000 < gc_at_exit.frozen, gc_at_exit


@pytest.mark.parametrize("enabled", [True, False])
def test_progress_bar_counts_steps_unless_turned_off(enabled):
    from lightning_seqmem.training.progress import StepProgressBar

    args = [a for a in SMALL if "enable_progress_bar" not in a] + [f"--trainer.enable_progress_bar={enabled}"]
    cli = cli_main(args, run=False)
    bars = [cb for cb in cli.trainer.callbacks if isinstance(cb, StepProgressBar)]
    assert len(bars) == (1 if enabled else 0)
    assert cli.trainer.progress_bar_callback is (bars[0] if enabled else None)


def test_the_batching_is_built_by_class_path_with_its_own_options(tmp_path, capsys):
    """``--data.batching`` takes a Pad, Truncate or Pack by class_path (or its short name), each with only its own
    options; the printed config feeds back; an option of another strategy is refused by name."""
    import os

    from lightning_seqmem.batching.options import Pack, Pad, Truncate

    args = ["--trainer.accelerator=cpu", "--data.batching=Pack", "--data.batching.method=wrapped"]
    cli = cli_main([*args, "--data.eval_batching=Truncate"], run=False)
    batching = cli.datamodule.settings.batching
    assert (batching.batching, batching.eval_batching) == (Pack(method="wrapped"), Truncate())
    with pytest.raises(SystemExit):
        cli_main([*args, "--print_config"], run=False)
    printed = capsys.readouterr().out
    assert "method: wrapped" in printed
    (tmp_path / "printed.yaml").write_text(printed)
    again = cli_main(["--config", str(tmp_path / "printed.yaml")], run=False).datamodule.settings.batching
    assert again.batching == Pack(method="wrapped")
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "cli.yaml")
    cli = cli_main(["--config", example, "--data.batching=Pad", "--data.batching.group_by_length=true"], run=False)
    assert cli.datamodule.settings.batching.batching == Pad(group_by_length=True)
    with pytest.raises(SystemExit):
        cli_main(["--data.batching=Pad", "--data.batching.method=wrapped"], run=False)
    assert "Option 'method' is not accepted" in capsys.readouterr().err


def _documented_commands():
    """The runnable ``seqmem-cli fit`` lines of README.md and docs/ (not those naming example packages or files)."""
    root = pathlib.Path(__file__).parents[1]
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for line in doc.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("seqmem-cli fit") and not any(x in line for x in ("my_pkg", "full.yaml", "`")):
                yield shlex.split(line)[2:]


@pytest.mark.parametrize("args", list(_documented_commands()), ids=" ".join)
def test_documented_commands_are_bounded_runs(args, monkeypatch):
    """The docs' SeqLengthWarmup command ran Lightning's default 1,000 epochs (770k steps) as written."""
    monkeypatch.chdir(pathlib.Path(__file__).parents[1])  # --config examples/cli.yaml is relative to the repo
    trainer = cli_main([*args, "--trainer.accelerator=cpu", "--trainer.logger=false"], run=False).trainer
    assert 0 < trainer.max_steps <= 10_000 or 0 < (trainer.max_epochs or 0) <= 10, (
        trainer.max_steps,
        trainer.max_epochs,
    )


@pytest.mark.slow
def test_a_mix_is_built_from_yaml(tmp_path, capsys):
    """``data.dataset`` takes a ``Mix`` by class_path, its weights overridable on the command line; the printed
    config feeds back."""
    import os

    from lightning_seqmem import Mix

    example = os.path.join(os.path.dirname(__file__), "..", "examples", "cli_mix.yaml")
    args = ["--trainer.accelerator=cpu", "--config", example]
    cli = cli_main([*args, "--data.dataset.init_args.weights.chat=0.5"], run=False)
    mix = cli.datamodule.dataset
    assert isinstance(mix, Mix) and mix.names == ("prose", "chat") and mix.weights == (0.7 / 1.2, 0.5 / 1.2)
    with pytest.raises(SystemExit):
        cli_main([*args, "--print_config"], run=False)
    (tmp_path / "printed.yaml").write_text(capsys.readouterr().out)
    assert cli_main(["--config", str(tmp_path / "printed.yaml")], run=False).datamodule.dataset == Mix(
        {"prose": "builtin", "chat": "builtin_chat"}, {"prose": 0.7, "chat": 0.3}
    )


@pytest.mark.parametrize("name", ["pad", "truncate", "pack", "pack_bfd", "pack_wrapped", "pad(to_max_length=true)"])
def test_every_batching_name_works_on_the_command_line(name):
    """The names of ``seqmem-train batching=...`` and ``seqmem-plan plan.strategies`` work as ``--data.strategy``."""
    from lightning_seqmem.batching.options import as_batching

    cli = cli_main(["--trainer.accelerator=cpu", f"--data.strategy={name}"], run=False)
    assert cli.datamodule.settings.batching.batching == as_batching(name)


def test_seqmem_cli_spells_a_fix_as_its_command_line_does(monkeypatch, capsys):
    """seqmem-cli says it is the surface: a message's fix reads ``--data.<key> <value>``, as a user of it types."""
    from lightning_seqmem.apps import cli
    from lightning_seqmem.messages import spell_data_option

    monkeypatch.setenv("LIGHTNING_SEQMEM_SURFACE", "python")  # put back after the test
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):  # main() configures the allocator: undone after
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(cli, "cli_main", lambda: print(spell_data_option("on_resume_mismatch", "restart_epoch")))
    cli.main()
    assert capsys.readouterr().out.strip() == "--data.on_resume_mismatch restart_epoch"


def test_prepare_data_per_node_is_a_datamodule_argument_the_cli_sets():
    """Lightning reads ``prepare_data_per_node`` from the DataModule; seqmem-cli sets it as ``--data.<key>``
    (docs/many_machines.md: one tokenization per job), and it is not one of the data settings."""
    cli = cli_main(["--trainer.accelerator=cpu", "--data.prepare_data_per_node=false"], run=False)
    assert cli.datamodule.prepare_data_per_node is False
    assert "prepare_data_per_node" not in cli.datamodule.hparams
    assert cli_main(["--trainer.accelerator=cpu"], run=False).datamodule.prepare_data_per_node is True
