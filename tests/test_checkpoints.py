"""The run's checkpoints (apps/checkpoints.py): written whole, ``last.ckpt`` one atomic swap of a link, and what
``ckpt_path=`` finds (``last``, a missing ``last.ckpt``, a folder, a wrong path) as a user meets it."""

import os

import pytest
import torch
from _forked_app import run_forked_main
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_seqmem.apps.checkpoints import RunCheckpoint, describe, newest_checkpoint, resolve_ckpt_path


def fit(tmp_path, every=2, max_steps=6, ckpt_path=None, **kw):
    ckpt = RunCheckpoint(dirpath=str(tmp_path / "checkpoints"), every_n_train_steps=every)
    trainer = Trainer(
        max_steps=max_steps,
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=str(tmp_path),
        **kw,
    )
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)
    return trainer, ckpt


def test_last_is_the_newest_checkpoint_itself(tmp_path):
    """One write per save: ``last.ckpt`` is a hard link to the step's file; the interval and max_steps are kept."""
    fit(tmp_path)
    folder = tmp_path / "checkpoints"
    assert sorted(os.listdir(folder)) == ["epoch=0-step=6.ckpt", "last.ckpt"]
    assert os.path.samefile(folder / "last.ckpt", folder / "epoch=0-step=6.ckpt")
    info = describe(str(folder / "last.ckpt"))
    assert (info["step"], info["every_n_train_steps"], info["max_steps"]) == (6, 2, 6)


def test_a_save_cut_short_leaves_no_checkpoint_under_its_name(tmp_path, monkeypatch):
    """A process killed while writing leaves the previous checkpoints whole and nothing half-written as a ``.ckpt``."""
    calls = []
    original = Trainer.save_checkpoint

    def dies_on_the_second(self, filepath, *args, **kwargs):
        calls.append(filepath)
        if len(calls) == 2:
            with open(filepath, "wb") as f:
                f.write(b"half")
            raise KeyboardInterrupt
        return original(self, filepath, *args, **kwargs)

    monkeypatch.setattr(Trainer, "save_checkpoint", dies_on_the_second)
    with pytest.raises(SystemExit):  # Lightning turns the interrupt into an exit
        fit(tmp_path)
    folder = tmp_path / "checkpoints"
    assert sorted(p for p in os.listdir(folder) if p.endswith(".ckpt")) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert describe(newest_checkpoint(str(folder)))["step"] == 2


# BoringModel's plain loader has no position to resume: Lightning says so on the mid-epoch resume this test makes
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_ckpt_path_last_and_a_missing_last(tmp_path):
    """``last`` is the newest checkpoint; a kill before ``last.ckpt``'s first swap leaves the step's file, which
    ``last`` and the path of ``last.ckpt`` find (and say so); nothing there starts afresh with a line saying it."""
    run = tmp_path / "run"
    path, note = resolve_ckpt_path("last", str(run))
    assert path is None and "no checkpoint in" in note and "training from step 0" in note
    fit(run, max_steps=4)
    os.remove(run / "checkpoints" / "last.ckpt")
    first = str(run / "checkpoints" / "epoch=0-step=4.ckpt")
    assert resolve_ckpt_path("last", str(run)) == (first, None)
    path, note = resolve_ckpt_path(str(run / "checkpoints" / "last.ckpt"), "elsewhere")
    assert path == first and "resuming from" in note
    trainer, _ = fit(run, max_steps=6, ckpt_path=path)
    assert trainer.global_step == 6


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["folder", "missing"])
def test_a_wrong_ckpt_path_is_one_line(tmp_path, kind):
    """A folder or a path that is not there: one line naming it and what to give, no traceback, before any data."""
    from lightning_seqmem.apps.train import main

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    torch.save({}, tmp_path / "run" / "checkpoints" / "last.ckpt")
    given = tmp_path / "run" if kind == "folder" else tmp_path / "nope.ckpt"
    proc = run_forked_main(main, ["seqmem-train", f"ckpt_path={given}", f"hydra.run.dir={tmp_path}/job"], tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith(f"ckpt_path={given}")]
    assert len(lines) == 1 and len(proc.stderr.strip().splitlines()) <= 4, proc.stderr  # Hydra's frame around it
    if kind == "folder":
        assert "is a folder" in lines[0] and f"ckpt_path={tmp_path}/run/checkpoints/last.ckpt" in lines[0]
    else:
        assert "no such file" in lines[0]


def test_a_sharded_checkpoint_folder_is_taken(tmp_path):
    """FSDP's sharded checkpoint is a folder (its shards and ``meta.pt``): taken as given, its step read from it."""
    folder = tmp_path / "epoch=0-step=3.ckpt"
    folder.mkdir()
    torch.save({"global_step": 3, "epoch": 0, "callbacks": {}, "loops": {}}, folder / "meta.pt")
    assert resolve_ckpt_path(str(folder), str(tmp_path)) == (str(folder), None)
    assert describe(str(folder))["step"] == 3
