"""What the apps print when something is wrong: a user's mistake as its message alone (before the model is built,
in the Hydra spelling), a bug with its traceback, everything with HYDRA_FULL_ERROR=1; "did you mean" for typos."""

import json
import os

import pytest
from _forked_app import run_forked_main

from lightning_seqmem.apps import errors
from lightning_seqmem.apps.errors import UserMistake, for_hydra, hydra_spelling, user_mistake
from lightning_seqmem.apps.overrides import check_overrides, config_groups
from lightning_seqmem.batching.options import as_batching


def _raised(call):
    try:
        call()
    except Exception as err:
        return err
    raise AssertionError("no error")


def test_our_checks_are_mistakes_and_other_errors_are_bugs():
    from hydra.errors import InstantiationException

    from lightning_seqmem.apps.planner import default_max_lengths

    check = _raised(lambda: as_batching("zip"))  # a raise statement of ours
    assert user_mistake(check) is check
    wrapped = InstantiationException("Error in call to target")
    wrapped.__cause__ = check
    assert user_mistake(wrapped) is check and str(for_hydra(wrapped)) == str(check)
    assert isinstance(for_hydra(wrapped), UserMistake)
    bug = _raised(lambda: default_max_lengths("512"))  # Python's TypeError on a line of ours: a bug
    assert isinstance(bug, TypeError) and user_mistake(bug) is None and for_hydra(bug) is bug
    outside = _raised(lambda: int("x"))  # raised outside the package
    assert user_mistake(outside) is None
    runtime = _raised(lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert user_mistake(runtime) is None


def test_a_mistake_in_an_instantiated_node_is_spelt_for_that_node():
    from hydra.errors import InstantiationException
    from omegaconf import OmegaConf

    from lightning_seqmem.kinds.detect import detect

    check = _raised(lambda: detect(["txt"]))
    wrapped = InstantiationException("Error in call to target 'lightning_seqmem.SeqMemDataModule':\nfull_key: data")
    wrapped.__cause__ = check
    cfg = OmegaConf.create({"data": {"text_column": "text"}, "model": {"lora": None}})
    assert "Pass data.text_column=<name>, or rename" in str(for_hydra(wrapped, cfg))
    assert "Pass text_column=<name> to SeqMemDataModule" in str(for_hydra(wrapped))  # no config: as raised


def test_python_spelling_becomes_hydra_spelling():
    text = "it has ['txt']. Pass text_column=<name> to SeqMemDataModule, or set SeqMemDataModule(cache_dir=...)."
    got = hydra_spelling(text, ["text_column", "cache_dir"], "data")
    assert got == "it has ['txt']. Pass data.text_column=<name>, or set SeqMemDataModule(cache_dir=...)."


def _train(tmp_path, *overrides, env=None):
    from lightning_seqmem.apps.train import main

    argv = ["seqmem-train", *overrides, f"hydra.run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"]
    return run_forked_main(main, argv, cwd=tmp_path, env=env)


@pytest.mark.slow
def test_missing_file_is_a_few_lines_before_the_trainer_and_recorded(tmp_path):
    proc = _train(tmp_path, "data=local", f"data.dataset={tmp_path / 'missing.jsonl'}")
    assert proc.returncode != 0
    assert "missing.jsonl' does not exist" in proc.stderr and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "HYDRA_FULL_ERROR" not in line]
    assert len(lines) <= 3, proc.stderr  # Hydra's "Error executing job with overrides" line and the message
    assert "GPU available" not in proc.stderr + proc.stdout  # the Trainer was never built
    status = json.load(open(tmp_path / "run" / "job_status.json"))
    assert status["status"] == "failed" and "FileNotFoundError" in status["error"]


@pytest.mark.slow
def test_full_error_shows_the_traceback(tmp_path):
    proc = _train(tmp_path, "data=local", f"data.dataset={tmp_path / 'missing.jsonl'}", env={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "local_files.py" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "rows, option, expected",
    [
        ([{"txt": f"words {i}"} for i in range(8)], "local", "Pass data.text_column=<name>, or rename"),
        (
            [{"prompt": f"q{i}", "chosen": "" if i == 3 else "yes", "rejected": "no"} for i in range(8)],
            "preference",
            "empty chosen completion",
        ),
    ],
)
def test_data_mistakes_arrive_before_the_model_in_hydra_spelling(tmp_path, rows, option, expected):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    proc = _train(tmp_path, f"data={option}", f"data.dataset={tmp_path / 'd.jsonl'}")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert expected in proc.stderr and "to SeqMemDataModule" not in proc.stderr
    assert "GPU available" not in proc.stderr + proc.stdout  # the Trainer was never built


@pytest.mark.slow
def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    from lightning_seqmem.apps import train

    def broken(datamodule, cfg):
        return datamodule.settings.no_such_setting  # an AttributeError: a bug, not a user's mistake

    monkeypatch.setattr(train, "check_data", broken)  # the forked child inherits it
    proc = _train(tmp_path, "trainer.max_steps=1")
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "no_such_setting" in proc.stderr


@pytest.mark.slow
def test_planner_typo_is_its_message_alone(tmp_path):
    from lightning_seqmem.apps.plan_app import main

    argv = ["seqmem-plan", "plan.strategies=[pack_bdf]", "plan.memory=false", f"hydra.run.dir={tmp_path}"]
    proc = run_forked_main(main, argv, cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "Unknown strategy 'pack_bdf'; choose one of" in proc.stderr and "Did you mean 'pack_bfd'?" in proc.stderr


def test_non_hydra_entry_points_print_a_mistake_alone(capsys, monkeypatch):
    with pytest.raises(SystemExit) as done:
        errors.exit_on_user_mistake(lambda: as_batching("zip"))
    assert done.value.code == 1 and capsys.readouterr().err.startswith("error: Unknown strategy 'zip'")
    with pytest.raises(TypeError):
        errors.exit_on_user_mistake(lambda: "a" + 1)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ValueError):
        errors.exit_on_user_mistake(lambda: as_batching("zip"))


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["data.max_lenght=128"], "did you mean data.max_length=128?"),
        (["trainer.max_step=2"], "did you mean trainer.max_steps=2?"),
        (["strategy=pack_bfd"], "it is batching=pack_bfd (options: pack, pack_bfd, pack_wrapped, pad, truncate)"),
        (["batching=pack_bdf"], "did you mean batching=pack_bfd?"),
        (["max_length=64"], "did you mean data.max_length=64?"),
        (["batching.method=wrapped"], "did you mean data.batching.method=wrapped?"),
        (["-m", "callbacks.seq_warmup.durtion=0.0,0.3"], "did you mean callbacks.seq_warmup.duration=0.0?"),
    ],
)
def test_typos_get_did_you_mean_and_no_plus_advice(overrides, expected):
    message = check_overrides(overrides, "config")
    assert expected in message and "+" not in message


def test_valid_overrides_pass():
    for overrides in (
        ["data=local", "data.dataset=x.jsonl", "batching=pack_wrapped", "trainer.max_steps=3"],
        ["-m", "callbacks.seq_warmup.duration=0.0,0.3", "+data.extra=1", "~callbacks.preallocate"],
        ["experiment=warmup_sweep", "+batching@data.eval_batching=pad", "hydra.run.dir=out"],
        ["logger=[csv,tensorboard]", "-m", "batching=pad,pack_wrapped"],
        ["hydra/launcher=basic", "hydra.job.chdir=false", "--cfg", "job"],
    ):
        assert check_overrides(overrides, "config") is None, overrides
    assert check_overrides(["plan.strategies=[pad]", "plan.gpu_memory=1GiB"], "plan") is None
    assert "plan.strategies" in check_overrides(["plan.strategie=[pad]"], "plan")
    assert {"pad", "truncate", "pack", "pack_bfd", "pack_wrapped"} <= set(config_groups()["batching"])


@pytest.mark.slow
def test_seqmem_train_stops_on_a_typo_before_hydra(tmp_path):
    proc = _train(tmp_path, "trainer.max_step=2")
    assert (
        proc.returncode == 1
        and proc.stderr.strip() == "Unknown config key 'trainer.max_step': did you mean trainer.max_steps=2?"
    )
    assert not (tmp_path / "run").exists()


def test_a_valid_command_line_is_composed_once_by_hydra_alone(monkeypatch):
    """Keys are checked only when Hydra's composition fails: a run whose overrides are right pays for one
    composition, Hydra's (each rank of a multi-process job used to compose twice). Until the job starts Hydra
    raises instead of printing; from the job's start on, its errors are Hydra's to report."""
    from lightning_seqmem.apps import overrides

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(overrides, "_compose", lambda *a: pytest.fail("composed before Hydra"))
    with overrides.overrides_checked(["trainer=cpu", "trainer.max_steps=2", "data.max_length=64"], "config"):
        assert os.environ["HYDRA_FULL_ERROR"] == "1"  # composition errors come back here
        overrides.job_started()
        assert "HYDRA_FULL_ERROR" not in os.environ  # the job's errors: Hydra's own report
    with pytest.raises(RuntimeError, match="the job's"):  # raised after the job started: not ours to reword
        with overrides.overrides_checked(["trainer=cpu"], "config"):
            overrides.job_started()
            raise RuntimeError("the job's")
    assert "HYDRA_FULL_ERROR" not in os.environ


def test_a_composition_error_gets_did_you_mean_or_hydra_s_own_report(monkeypatch, capsys):
    from hydra.errors import ConfigCompositionException

    from lightning_seqmem.apps.overrides import overrides_checked

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as done, overrides_checked(["trainer.max_step=2"], "config"):
        raise ConfigCompositionException("Could not override 'trainer.max_step'.")  # what Hydra raises
    assert done.value.code == 1
    assert capsys.readouterr().err.strip() == "Unknown config key 'trainer.max_step': did you mean trainer.max_steps=2?"
    with pytest.raises(SystemExit) as done, overrides_checked(["hydra.run.dir=/x"], "config"):
        raise ConfigCompositionException("something only Hydra can say")  # no message of ours: Hydra prints it
    assert done.value.code == 1 and "something only Hydra can say" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done, overrides_checked(["model=tiny_lama"], "config"):
        pytest.fail("a group option that does not exist is refused before Hydra starts")
    assert "did you mean model=tiny_llama?" in capsys.readouterr().err
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # the user asked for tracebacks: the error as raised
    with pytest.raises(ConfigCompositionException), overrides_checked(["trainer.max_step=2"], "config"):
        raise ConfigCompositionException("Could not override 'trainer.max_step'.")


@pytest.mark.slow
def test_a_typo_in_a_multirun_stops_it_before_its_first_job(tmp_path):
    proc = _train(tmp_path, "-m", "trainer.max_step=2,3", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip() == "Unknown config key 'trainer.max_step': did you mean trainer.max_steps=2?"
    assert not (tmp_path / "sweep").exists()
