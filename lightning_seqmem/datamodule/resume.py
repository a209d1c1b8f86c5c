"""Resume: the map-style loader that can skip a saved position, and the check of a checkpoint's data signature.

A Lightning checkpoint saves the loader's position in an epoch; that position means something only for the same
rows in the same batches. ``SeqMemDataModule.state_dict`` saves the settings that decide them
(``BatchingSettings.signature``) with a checksum of the train row lengths; :func:`check_signature` compares.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

try:  # exact mid-epoch resume through Lightning checkpoints when torchdata is installed
    from torchdata.stateful_dataloader import StatefulDataLoader as _Loader
except ImportError:  # pragma: no cover - the samplers still resume through their own state_dict
    _Loader = DataLoader

__all__ = ["ResumableLoader", "SavesSignature", "check_signature", "data_signature"]


class ResumableLoader(_Loader):
    """The map-style loader; ``skip_resume_state`` makes it start its epoch afresh instead of loading a saved
    position (set when the checkpoint's data differ from this run's: the old position would point at other rows)."""

    skip_resume_state = False

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.skip_resume_state or not hasattr(_Loader, "load_state_dict"):
            return
        saved_workers = state_dict.get("_snapshot", {}).get("_main_snapshot", {}).get("_num_workers", 0)
        if saved_workers == self.num_workers or not hasattr(self.sampler, "load_state_dict"):
            super().load_state_dict(state_dict)
            return
        # Another number of workers (torchdata resumes only the same): the batches are the sampler's, the same for
        # any number of workers, so the sampler alone goes on after the batches the saved run had yielded.
        snapshot = state_dict.get("_snapshot")
        if snapshot is None:
            index_state, done = state_dict.get("_index_sampler_state"), state_dict.get("_num_yielded", 0)
        else:
            main = snapshot["_main_snapshot"]
            index_state = main.get("_index_sampler_state")
            done = snapshot["_snapshot_step"] + state_dict.get("_steps_since_snapshot", 0)
        if index_state is not None and not state_dict.get("_iterator_finished"):
            self.sampler.load_state_dict(dict(index_state, batches_yielded=done))


def data_signature(settings: dict[str, Any], train_lengths: np.ndarray | None) -> dict[str, Any]:
    """The settings that decide the train rows and batches, with the train row count and a checksum of their
    lengths (so another dataset or tokenizer shows too)."""
    lengths = np.ascontiguousarray(train_lengths if train_lengths is not None else np.zeros(0), dtype=np.int64)
    return dict(settings, train_rows=int(lengths.size), train_lengths_crc32=zlib.crc32(lengths))


def check_signature(saved: dict[str, Any], now: dict[str, Any], on_mismatch: str, warn: Callable[[str], None]) -> bool:
    """Whether the loader must skip the checkpoint's position: ``False`` for the same data; for other data raise
    (``on_mismatch="error"``) or warn and return ``True`` (``"restart_epoch"``)."""
    # a setting the checkpoint did not record (saved by an earlier version) is not compared
    changed = {k: (saved.get(k), now.get(k)) for k in now if k in saved and saved.get(k) != now.get(k)}
    if not changed:
        return False
    if "train_lengths_crc32" in changed and "train_rows" not in changed and len(changed) == 1:
        what = "the train rows have other lengths (another dataset, tokenizer or packing)"
    else:
        what = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items() if k != "train_lengths_crc32")
    if on_mismatch == "error":
        raise ValueError(
            f"Cannot resume the data position of this checkpoint: it was saved with other data ({what}), so the "
            "batches it had already yielded are not this run's. Resume with the same data settings, or pass "
            "on_resume_mismatch='restart_epoch' to keep the checkpoint's model and optimizer and start the "
            "current epoch from its first batch (or start a new run without ckpt_path)."
        )
    warn(
        f"The checkpoint's data differ from this run's ({what}): the current epoch restarts from its "
        "first batch (on_resume_mismatch='restart_epoch'); model and optimizer state are resumed."
    )
    return True


class SavesSignature:
    """A read mode whose part of a checkpoint is its data signature: saved, and compared when a run resumes from it
    (Lightning restores the DataModule before the loader). Another dataset or batching is refused by name, or sets
    ``skip_resume_state`` so the loader starts the epoch afresh (``on_resume_mismatch="restart_epoch"``)."""

    settings: Any
    skip_resume_state = False

    def data_signature(self) -> dict[str, Any]:  # each read mode says what decides its rows
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"data_signature": self.data_signature()}

    def load_state_dict(self, state_dict: dict[str, Any], warn: Callable[[str], None]) -> None:
        saved = state_dict.get("data_signature")
        if saved:
            mismatch = self.settings.data.on_resume_mismatch
            self.skip_resume_state = check_signature(saved, self.data_signature(), mismatch, warn)
