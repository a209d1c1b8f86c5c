"""seqmem-plan: composes the same groups as seqmem-train and plans exactly that run."""

import json
import subprocess
import sys

import pytest
from _forked_app import run_forked_main
from hydra import compose, initialize_config_module
from hydra.utils import instantiate

from lightning_seqmem.apps.plan_app import plan_from_config
from lightning_seqmem.batching.options import Pack

pytestmark = pytest.mark.filterwarnings("ignore:.*never reach the model.*")


def _compose(name, overrides):
    with initialize_config_module("lightning_seqmem.conf", version_base="1.3"):
        return compose(name, overrides=overrides, return_hydra_config=False)


def test_plan_composes_the_run_seqmem_train_would_launch_and_matches_its_datamodule():
    overrides = [
        "batching=pack_wrapped",
        "data.max_length=128",
        "data.micro_batch_size=4",
        "model=tiny_gpt2",
        "trainer.accumulate_grad_batches=2",
    ]
    plan_cfg = _compose("plan", overrides + ["plan.memory=false", "plan.max_lengths=[64,128]"])
    train_cfg = _compose("config", overrides)
    for group in ("data", "model", "trainer", "callbacks"):  # data.batching included
        assert plan_cfg[group] == train_cfg[group]
    plan, _ = plan_from_config(plan_cfg)
    dm = instantiate(train_cfg.data)
    configured = plan.configured
    assert (configured.batching, configured.max_length) == (Pack(method="wrapped"), 128)
    assert configured in plan.strategies  # one of the candidates of plan.strategies, compared as objects
    assert configured.token_efficiency == dm.stats()["train"]["token_efficiency"]
    assert configured.max_batch_shape == dm.max_batch_shape()
    assert configured.optimizer_steps == -(-dm.stats()["train"]["batches"] // 2)


@pytest.mark.slow
def test_seqmem_plan_command_prints_the_tables_and_writes_plan_json_and_histogram(tmp_path):
    """``seqmem-plan`` as run from a shell, its ``main()`` in a forked child (tests/_forked_app.py); the console
    script in a fresh interpreter is run by test_seqmem_plan_prints_each_log_line_once."""
    from lightning_seqmem.apps.plan_app import main

    argv = [
        "seqmem-plan",
        "batching=pad",
        "model=tiny_llama",
        "data.max_length=128",
        "plan.max_lengths=[64,128]",
        "plan.micro_batch_sizes=[1,2]",
        "plan.gpu_memory=2GiB",
        f"hydra.run.dir={tmp_path}",
    ]
    out = run_forked_main(main, argv, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    for text in (
        "pack_bfd ",
        "pad(to_max_length=True) ",
        "token",
        "Peak training memory",
        "Recommended: strategy=",
        "Why: ",
    ):
        assert text in out.stdout
    record = json.loads((tmp_path / "plan.json").read_text())
    assert record["recommended"]["micro_batch_size"] == 2 and len(record["strategies"]) == 10
    for picture in ("lengths.png", "strategies.png", "memory.png"):  # what is on them: tests/test_plots.py
        assert (tmp_path / picture).read_bytes()[:4] == b"\x89PNG", picture
    assert f"pictures: {tmp_path / 'lengths.png'}" in out.stdout


def test_prompt_completion_data_gets_its_two_panel_histogram_and_a_clear_error(tmp_path):
    rows = [{"prompt": "question " * (1 + i % 9), "completion": "answer " * (1 + i % 4)} for i in range(40)]
    (tmp_path / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = _compose(
        "plan",
        [
            "data=local",
            f"data.dataset={tmp_path / 'sft.jsonl'}",
            "plan.memory=false",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
    )
    with pytest.raises(ValueError, match="prompt/completion data is not supported yet .*lengths.png"):
        plan_from_config(cfg, str(tmp_path / "out"))
    assert (tmp_path / "out" / "lengths.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_plan_settings_fail_with_a_clear_message():
    cfg = _compose("plan", ["plan.strategies=[pad,zip]", "plan.memory=false"])
    with pytest.raises(
        ValueError, match=r"Unknown strategy 'zip'; choose one of \['pad', 'truncate', 'pack_bfd', 'pack_wrapped'\]"
    ):
        plan_from_config(cfg)
    cfg = _compose("plan", ["plan.max_lengths=[]", "plan.memory=false"])
    with pytest.raises(ValueError, match="non-empty list"):
        plan_from_config(cfg)
    cfg = _compose("plan", ["plan.stream_sample=0", "plan.memory=false"])
    with pytest.raises(ValueError, match=r"plan.stream_sample must be an int >= 1 .*got 0"):
        plan_from_config(cfg)


def test_seqmem_plan_chooses_the_trainer_seqmem_train_would(monkeypatch, capsys):
    """On a machine with a GPU (simulated) the planner plans the gpu run that seqmem-train launches by default."""
    import sys

    import lightning.fabric.accelerators.cuda as cuda

    from lightning_seqmem.apps import plan_app

    monkeypatch.setattr(cuda, "num_cuda_devices", lambda: 1)
    monkeypatch.setattr(sys, "argv", ["seqmem-plan", "batching=pad"])
    seen = []
    monkeypatch.setattr(plan_app, "_hydra_entry", lambda: seen.append(list(sys.argv[1:])))
    plan_app.main()
    assert seen == [["batching=pad", "trainer=gpu"]]
    assert "1 CUDA GPU visible: planning for trainer=gpu" in capsys.readouterr().err


def test_plan_of_dpo_with_a_reference_copy_counts_the_copy():
    from lightning_seqmem.apps.plan_app import _reference_copy

    assert _reference_copy(_compose("plan", ["data=preference", "model=dpo"]))
    assert not _reference_copy(_compose("plan", ["data=preference", "model=dpo", "model.reference=precomputed"]))
    assert not _reference_copy(_compose("plan", []))  # a language model: no copy


def test_seqmem_plan_on_a_stream_plans_its_first_documents_and_says_so():
    cfg = _compose(
        "plan",
        [
            "batching=pack_bfd",
            "data.streaming=true",
            "plan.stream_sample=500",
            "plan.memory=false",
            "plan.max_lengths=[64,128]",
        ],
    )
    plan, notes = plan_from_config(cfg)
    assert any("a stream: planned on its first 500 training documents" in note for note in notes)
    assert len(plan.train_lengths) == 500 and {s.max_length for s in plan.strategies} == {64, 128}


@pytest.mark.slow
def test_seqmem_plan_prints_each_log_line_once(tmp_path):
    """trainer=cpu skips choose_trainer's CUDA probe, so Lightning is first imported under Hydra's job logging:
    its own console handler and Hydra's root handler printed every record twice. A fresh interpreter, as the
    console script starts one (a forked child has Lightning imported already)."""
    cmd = [sys.executable, "-m", "lightning_seqmem.apps.plan_app", "trainer=cpu", "batching=pad", "model=tiny_llama"]
    cmd += ["data.max_length=128", "plan.max_lengths=[64]", "plan.micro_batch_sizes=[1]", "plan.memory=false"]
    out = subprocess.run(cmd + [f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "[lightning_seqmem] train: tokens" in line]
    assert len(lines) == 1, lines
    assert "[lightning_seqmem] train: tokens" in (tmp_path / "plan_app.log").read_text()  # and in the job's log


@pytest.mark.slow
def test_the_table_and_the_fit_search_trace_each_configuration_once(monkeypatch):
    """The memory table and the fit search ask for some of the same estimates (the configured run at its worst shape,
    the cheap levers at the run's micro-batch): each distinct question is traced once per process
    (``layer_scaling.cached_scaled``, however its arguments are spelled)."""
    import functools
    import inspect

    from lightning_seqmem.apps import plan_search
    from lightning_seqmem.memory import layer_scaling

    real_trace, real_ask = layer_scaling.scaled_training_memory, layer_scaling.cached_scaled
    traced, asked = [], []

    def question(model_config, *args, **kwargs):
        bound = inspect.signature(real_trace).bind(model_config, *args, **kwargs)
        bound.apply_defaults()
        return repr(
            {**bound.arguments, "model_config": model_config.to_json_string(), "keys": tuple(bound.arguments["keys"])}
        )

    @functools.wraps(real_trace)
    def trace(*args, **kwargs):
        traced.append(question(*args, **kwargs))
        return real_trace(*args, **kwargs)

    def ask(*args, **kwargs):
        asked.append(question(*args, **kwargs))
        return real_ask(*args, **kwargs)

    monkeypatch.setattr(layer_scaling, "_SCALED", {})
    monkeypatch.setattr(layer_scaling, "scaled_training_memory", trace)
    monkeypatch.setattr(layer_scaling, "cached_scaled", ask)
    monkeypatch.setattr(plan_search, "cached_scaled", ask)
    cfg = _compose(
        "plan",
        [
            "trainer=gpu",
            "model.model_config={model_type:llama,hidden_size:64,intermediate_size:128,num_hidden_layers:4,"
            "num_attention_heads:4,num_key_value_heads:2}",
            "model.vocab_size=512",
            "data.max_length=128",
            "plan.max_lengths=[128]",
            "plan.micro_batch_sizes=[8]",
            "plan.strategies=[pack_bfd]",
            "plan.gpu_memory=12MiB",  # the run as configured does not fit: the search tries levers
        ],
    )
    plan, _ = plan_from_config(cfg)
    assert plan.fit is not None and len(plan.fit.tried) >= 3
    assert len(asked) > len(set(asked))  # the same question asked more than once ...
    assert sorted(traced) == sorted(set(asked))  # ... traced once
