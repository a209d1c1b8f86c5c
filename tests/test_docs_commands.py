"""Every command of docs/resuming.md, docs/mixing.md and docs/oom.md, run as written (in order, in one folder per
page, each a process of its own), shrunk to a few steps: a page's commands work on the shipped config, and do
what the page says they do."""

import json
import pathlib
import re
import shlex

import pytest
from _forked_app import run_forked_main
from _job_imports import import_job_modules

ROOT = pathlib.Path(__file__).parents[1]
PAGES = ("resuming.md", "mixing.md", "oom.md")

# Replaced where a command sets them, else added (seqmem-train); a resuming run trains one step more.
TRAIN_SHRINK = {
    "trainer.max_steps": "2",
    "trainer.val_check_interval": "2",
    "trainer.limit_val_batches": "1",
    "data.max_length": "64",
    "checkpoint_every_n_steps": "2",
}
CLI_SHRINK = ["--trainer.max_steps=2", "--trainer.limit_val_batches=1", "--data.init_args.max_length=64"]


def page_commands(page: str) -> list[str]:
    """The command lines of a page's ```bash blocks (comments and a script's ``srun`` taken off)."""
    text = (ROOT / "docs" / page).read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            line = line.removeprefix("srun ")
            if line.startswith("seqmem-"):
                lines.append(line)
    return lines


def shrink_train(args: list[str]) -> list[str]:
    out, given = [], set()
    for arg in args:
        key = arg.split("=", 1)[0]
        if key in TRAIN_SHRINK and "=" in arg:
            given.add(key)
            arg = f"{key}={TRAIN_SHRINK[key]}"
        out.append(arg)
    extra = [f"{k}={v}" for k, v in TRAIN_SHRINK.items() if k not in given and k != "checkpoint_every_n_steps"]
    if any("inject_oom" in a for a in args):  # the pretend limit halved with the rows' length: 8 x 64 tokens fail
        extra.append("callbacks.inject_oom.max_tokens=256")
    if any(a.startswith("ckpt_path=") for a in out):
        extra = [a for a in extra if not a.startswith("trainer.max_steps")]
        out = [a for a in out if not a.startswith("trainer.max_steps")] + ["trainer.max_steps=3"]
    return out + extra + ["~callbacks.preallocate", "print_summary=false"]


def run_command(line: str, cwd: pathlib.Path, index: int):
    """Run one command line; a single seqmem-train run without a folder of its own gets ``outputs/cmd<index>``."""
    from lightning_seqmem.apps import cli, plan_app, report, train

    argv = shlex.split(line.replace("$SLURM_JOB_ID", "7"))
    program, args = argv[0], argv[1:]
    if program == "seqmem-train":
        main, args = train.main, shrink_train(args)
        if not any(a.startswith("hydra.run.dir=") for a in args) and "-m" not in args:
            args.append(f"hydra.run.dir=outputs/cmd{index}")
    elif program == "seqmem-cli":
        main, args = cli.main, [*args, *CLI_SHRINK, "--trainer.logger=false"]
    elif program == "seqmem-plan":
        main, args = plan_app.main, [*args, "plan.memory=false", "plan.histogram=null", "plan.strategy_chart=null"]
    elif program == "seqmem-report":
        main = report.main
    else:
        raise AssertionError(f"a command the test does not know: {line}")
    return run_forked_main(main, [program, *args], cwd, timeout=600)


@pytest.fixture(scope="module", params=PAGES)
def page_runs(request, tmp_path_factory):
    """Each command of the page, in order, in one folder (a resume finds the run before it)."""
    import_job_modules()  # once here, not in each forked command
    cwd = tmp_path_factory.mktemp(request.param.split(".")[0])
    if request.param != "mixing.md":  # examples/cli.yaml is read from the repository's root
        (cwd / "examples").symlink_to(ROOT / "examples")
    commands = page_commands(request.param)
    return request.param, cwd, [(line, run_command(line, cwd, i)) for i, line in enumerate(commands)]


@pytest.mark.slow
def test_every_command_of_the_page_runs_and_does_what_it_says(page_runs):
    page, cwd, runs = page_runs
    assert runs, f"no command found in {page}"
    for line, proc in runs:
        assert proc.returncode == 0, (line, (proc.stdout + proc.stderr)[-3000:])
    out = {line: proc.stdout + proc.stderr for line, proc in runs}
    lines = list(out)
    if page == "resuming.md":
        resumed = r"resuming from \S*outputs/stream1/checkpoints/last\.ckpt: step 2, epoch 0, stream read to document"
        assert re.search(resumed, out[lines[1]]), out[lines[1]][-3000:]
        slurm = next(line for line in lines if "SLURM_JOB_ID" in line)
        assert re.search(r"no checkpoint in \S*outputs/7/checkpoints yet", out[slurm])  # a first attempt
    elif page == "mixing.md":
        assert "shares of the tokens trained: prose 58.3 %, chat 41.7 %" in out[lines[0]]
        assert "shares of the tokens trained: prose 87.5 %, chat 12.5 %" in out[lines[1]]  # the sweep's first job
        assert "chat" in out[lines[2]] and "read 1.0" in out[lines[3]]
    else:
        injected = [i for i, line in enumerate(lines) if "inject_oom" in line]
        assert len(injected) == 2
        for i in injected:
            summary = json.load(open(cwd / "outputs" / f"cmd{i}" / "summary.json"))
            assert summary["oom_splits"] >= 1, lines[i]


@pytest.mark.slow
def test_the_python_recipe_of_oom_runs_on_a_cpu(tmp_path):
    """docs/oom.md's CPU recipe, as written (two steps instead of four): the injected out-of-memory is split."""
    text = (ROOT / "docs" / "oom.md").read_text()
    section = text[text.index("## Trying it without a GPU") :]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0].replace("max_steps=4", "max_steps=2")
    import_job_modules()
    proc = run_forked_main(lambda: exec(code, {"__name__": "__main__"}), ["python"], tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^[1-9]\d* micro-batches split", proc.stdout, re.M), proc.stdout
