"""Resume: the one policy of every read path (the checkpoint's data signature checked, refused by name or the epoch
restarted) and the map-style loader that skips a saved position or goes on with another worker count.

A Lightning checkpoint saves the loader's position in an epoch; that position means something only for the same
rows in the same batches. ``SeqMemDataModule.state_dict`` saves what decides them (``signature.read_signature``);
:func:`check_signature` compares. No Lightning import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader

from lightning_seqmem.datamodule.signature import changed_settings, read_signature
from lightning_seqmem.messages import spell_data_option

try:  # exact mid-epoch resume through Lightning checkpoints when torchdata is installed
    from torchdata.stateful_dataloader import StatefulDataLoader as _Loader
except ImportError:  # pragma: no cover - the samplers still resume through their own state_dict
    _Loader = DataLoader

__all__ = ["ResumableLoader", "SavesSignature", "check_signature"]


class ResumableLoader(_Loader):
    """The map-style loader; ``restart`` (given when it is built) makes it start its epoch afresh instead of loading
    a saved position (the checkpoint's data differ from this run's: the old position would point at other rows)."""

    def __init__(self, *args: Any, restart: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.restart = restart

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.restart or not hasattr(_Loader, "load_state_dict"):
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


def check_signature(saved: dict[str, Any], now: dict[str, Any], on_mismatch: str, warn: Callable[[str], None]) -> bool:
    """The one resume policy of every read path: whether the loader must skip the checkpoint's position. ``False``
    for the same data; for other data raise naming each changed setting (``on_mismatch="error"``) or warn and
    return ``True`` (``"restart_epoch"``)."""
    changed = changed_settings(saved, now)
    if not changed:
        return False
    what, restart = ", ".join(changed), spell_data_option("on_resume_mismatch", "restart_epoch")
    if on_mismatch == "error":
        raise ValueError(
            f"Cannot resume the data position of this checkpoint: it was saved with other data ({what}), so the "
            f"batches it had already yielded are not this run's. Resume with the same data settings, or pass "
            f"{restart} to keep the checkpoint's model and optimizer and start the current epoch from its first "
            "batch (or start a new run without ckpt_path)."
        )
    warn(
        f"The checkpoint's data differ from this run's ({what}): the current epoch restarts from its first batch "
        f"({restart}); model and optimizer state are resumed."
    )
    return True


class SavesSignature:
    """A read mode whose part of a checkpoint is its data signature (``signature.read_signature``): saved, and
    compared when a run resumes from it (Lightning restores the DataModule before it builds the loader, which gets
    ``restart`` when it is built). Each read mode says only what identifies its sources (``identity``).

    Attributes:
        streaming: whether the sources are read as streams.
        restart: the checkpoint's data differ and ``on_resume_mismatch="restart_epoch"``: loaders start afresh.
    """

    settings: Any
    kind: Any
    streaming = False
    restart = False
    mix: Any = None
    tokenizer: Callable[[], Any]
    _tokenizer_key: str | None = None

    def identity(self) -> dict[str, Any]:  # each read mode says what identifies its documents
        raise NotImplementedError

    def mix_seed(self) -> int | None:
        return None

    @property
    def pretokenized(self) -> bool:
        """The sources hold token ids (no tokenizer decides their rows)."""
        return self.kind.pretokenized

    def tokenizer_key(self) -> str | None:
        """The tokenizer's fingerprint, once (hashing a large vocabulary takes a while); ``None`` for token ids."""
        if self.pretokenized:
            return None
        if self._tokenizer_key is None:
            from lightning_seqmem.data.backend import tokenizer_fingerprint

            tokenizer = self.tokenizer()
            self._tokenizer_key = tokenizer_fingerprint(tokenizer) if tokenizer is not None else ""
        return self._tokenizer_key or None

    def data_signature(self) -> dict[str, Any]:
        """What a saved loader position refers to (``signature.read_signature``)."""
        return read_signature(
            self.kind, self.settings, self.streaming, self.tokenizer_key(), self.identity(), self.mix, self.mix_seed()
        )

    def state_dict(self) -> dict[str, Any]:
        return {"data_signature": self.data_signature()}

    def load_state_dict(self, state_dict: dict[str, Any], warn: Callable[[str], None]) -> None:
        saved = state_dict.get("data_signature")
        if saved:
            mismatch = self.settings.data.on_resume_mismatch
            self.restart = check_signature(saved, self.data_signature(), mismatch, warn)
