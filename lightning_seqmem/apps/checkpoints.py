"""Checkpoints of ``seqmem-train`` a user can count on after a pre-emption.

``RunCheckpoint`` writes each checkpoint once, to a temporary name renamed into place (a kill mid-write leaves no
half file under a checkpoint's name), and keeps ``last.ckpt`` as a hard link to it swapped in atomically (a copy
where links are not allowed): no second 28 MB write, and at every moment ``last.ckpt`` is a whole checkpoint. It
also records its interval and ``max_steps`` in the checkpoint, so a resumed run keeps saving as before and is
warned when its schedule changes. ``resolve_ckpt_path`` turns ``ckpt_path=`` (a file, ``last``) into a file or a
one-line error; ``describe`` reads what the resume line says.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

__all__ = ["CHECKPOINT_DIR", "RunCheckpoint", "describe", "newest_checkpoint", "resolve_ckpt_path"]

CHECKPOINT_DIR = "checkpoints"  # <run dir>/checkpoints
LAST = "last.ckpt"
SHARDED_META = "meta.pt"  # what Lightning writes beside a sharded checkpoint's shards (FSDP)
_PART = ".part"  # a checkpoint being written


class RunCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint(every_n_train_steps=N, save_last=True, save_top_k=1)`` whose files appear whole.

    Args:
        dirpath: the folder of the checkpoints (``<run dir>/checkpoints``).
        every_n_train_steps: a checkpoint every N optimizer steps.
        resuming: the run resumes from a checkpoint (of this folder, perhaps): its files are no surprise there.

    Example::

        RunCheckpoint(dirpath="run/checkpoints", every_n_train_steps=500)  # run/checkpoints/last.ckpt
    """

    def __init__(self, dirpath: str, every_n_train_steps: int, resuming: bool = False) -> None:
        super().__init__(
            dirpath=dirpath,
            every_n_train_steps=every_n_train_steps,
            save_last="link",
            save_top_k=1,
            enable_version_counter=False,  # last.ckpt is replaced, not joined by last-v1.ckpt after a resume
        )
        self._max_steps: int | None = None
        self._resuming = resuming  # the folder holds the checkpoints resumed from: not worth a warning

    @property
    @override
    def state_key(self) -> str:
        # One key whatever the interval: a resume with another interval finds its state and Lightning does not
        # warn that the checkpoint's callback is missing.
        return "RunCheckpoint"

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._max_steps = trainer.max_steps

    def _ModelCheckpoint__warn_if_dir_not_empty(self, dirpath: Any) -> None:  # Lightning's private check, by name
        if not self._resuming:  # a run resumed into its own folder finds its checkpoints there: no warning
            super()._ModelCheckpoint__warn_if_dir_not_empty(dirpath)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "every_n_train_steps": self._every_n_train_steps, "max_steps": self._max_steps}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("dirpath") == self.dirpath:  # another folder: nothing of its files to keep track of
            super().load_state_dict(state_dict)

    @override
    def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
        part = filepath + _PART
        super()._save_checkpoint(trainer, part)
        if trainer.is_global_zero and os.path.exists(part):
            os.replace(part, filepath)
        self._last_checkpoint_saved = filepath

    @staticmethod
    @override
    def _link_checkpoint(trainer: Any, filepath: str, linkpath: str) -> None:
        if os.path.isdir(filepath):  # a sharded checkpoint (a folder): Lightning's symlink
            return ModelCheckpoint._link_checkpoint(trainer, filepath, linkpath)
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            part = linkpath + _PART
            if os.path.lexists(part):
                os.remove(part)
            try:
                os.link(filepath, part)
            except OSError:  # a file system without hard links
                shutil.copyfile(filepath, part)
            os.replace(part, linkpath)  # atomic: last.ckpt is the old checkpoint or the new one, never neither
        trainer.strategy.barrier()
        return None


def _step_of(path: str) -> int:
    found = re.search(r"step=(\d+)", os.path.basename(path))
    return int(found[1]) if found else -1


def newest_checkpoint(folder: str) -> str | None:
    """``folder/last.ckpt`` if there, else the checkpoint of the highest step in ``folder`` (a kill can come between
    a checkpoint's save and ``last.ckpt``'s swap), else ``None``."""
    last = os.path.join(folder, LAST)
    if os.path.exists(last):
        return last
    found = [p for p in glob.glob(os.path.join(folder, "*.ckpt")) if os.path.exists(p)]
    return max(found, key=lambda p: (_step_of(p), os.path.getmtime(p))) if found else None


def resolve_ckpt_path(value: Any, run_dir: str) -> tuple[str | None, str | None]:
    """``ckpt_path=`` as the app takes it: ``(checkpoint file or None, a line to print or None)``.

    ``last`` is the newest checkpoint in ``<run dir>/checkpoints`` (with ``hydra.run.dir`` fixed, the requeue
    pattern); none there yet starts from scratch and says so. A missing ``last.ckpt`` whose folder has another
    checkpoint resumes from that one and says so.

    Raises:
        FileNotFoundError: the path does not exist (and no checkpoint beside it), or is a folder.
    """
    if value is None or value == "":
        return None, None
    folder = os.path.join(run_dir, CHECKPOINT_DIR)
    if value == "last":
        found = newest_checkpoint(folder)
        if found is None:
            return None, (
                f"ckpt_path=last: no checkpoint in {folder} yet, training from step 0 (a fresh folder each run "
                "unless hydra.run.dir is fixed: docs/resuming.md)."
            )
        return found, None
    path = os.path.expanduser(str(value))
    if os.path.isfile(os.path.join(path, SHARDED_META)):  # a sharded (FSDP) checkpoint is a folder
        return path, None
    if os.path.isdir(path):
        inside = newest_checkpoint(os.path.join(path, CHECKPOINT_DIR)) or newest_checkpoint(path)
        hint = f"e.g. ckpt_path={inside}" if inside else f"there is no checkpoint in {path}"
        raise FileNotFoundError(
            f"ckpt_path={value} is a folder; give a checkpoint file ({hint}), or ckpt_path=last with "
            f"hydra.run.dir=<the run's folder>."
        )
    if not os.path.exists(path):
        beside = newest_checkpoint(os.path.dirname(path) or ".") if os.path.basename(path) == LAST else None
        if beside is not None:
            return beside, f"{path} is not there (a stop before its first swap): resuming from {beside}."
        raise FileNotFoundError(
            f"ckpt_path={value}: no such file. A run keeps its checkpoints in <run dir>/{CHECKPOINT_DIR}/ "
            "when started with checkpoint_every_n_steps=N."
        )
    return path, None


def describe(path: str) -> dict[str, Any]:
    """What a checkpoint says about the run it stopped: ``step``, ``epoch``, ``every_n_train_steps``, ``max_steps``
    (``None`` where it does not say) and ``data``, how far the train loader had read (words, or ``None``)."""
    import torch

    sharded = os.path.isdir(path)
    # mmap: a large checkpoint's tensors are not read, only the few counters this needs
    where = os.path.join(path, SHARDED_META) if sharded else path
    ckpt = torch.load(where, map_location="cpu", weights_only=False, mmap=not sharded)
    info: dict[str, Any] = {"step": ckpt.get("global_step"), "epoch": ckpt.get("epoch")}
    info["every_n_train_steps"] = info["max_steps"] = None
    for key, state in (ckpt.get("callbacks") or {}).items():
        if key == "RunCheckpoint":
            info["every_n_train_steps"] = state.get("every_n_train_steps")
            info["max_steps"] = state.get("max_steps")
        elif str(key).startswith("ModelCheckpoint") and info["every_n_train_steps"] is None:
            found = re.search(r"'every_n_train_steps': (\d+)", str(key))  # a checkpoint of an earlier version
            info["every_n_train_steps"] = int(found[1]) or None if found else None
    loops = ckpt.get("loops", {}).get("fit_loop", {})
    info["data"] = _data_position(loops.get("state_dict", {}).get("combined_loader"))
    return info


def _data_position(loaders: Any) -> str | None:
    """Words for the train loader's saved position: a map-style sampler's batches of its epoch, or how many
    documents a stream's readers had numbered (all ranks and loader workers)."""
    if not loaders:
        return None
    state = loaders[0] if isinstance(loaders, list) else loaders
    if not isinstance(state, dict):
        return None
    sampler = state.get("_index_sampler_state")
    if isinstance(sampler, dict) and "batches_yielded" in sampler:
        return f"{sampler['batches_yielded']:,} batches of epoch {sampler.get('epoch', 0)} read"
    readers = list(_readers(state))
    if not readers:
        return None
    documents = sum(int(r["index"]) for r in readers)
    passes = max(int(r.get("passes") or 0) for r in readers)
    again = f", pass {passes + 1}" if passes else ""
    return f"stream read to document {documents:,} ({len(readers)} reader{'s' * (len(readers) > 1)}{again})"


def _readers(state: Any, depth: int = 0):
    """The stream readers' states in a saved loader state (each has its ``index``: documents numbered)."""
    if depth > 8:
        return
    if isinstance(state, dict):
        if isinstance(state.get("index"), int) and "worker" in state and "passes" in state:
            yield state
            return
        items = state.values()
    elif isinstance(state, (list, tuple)):
        items = state
    else:
        return
    for item in items:
        yield from _readers(item, depth + 1)
