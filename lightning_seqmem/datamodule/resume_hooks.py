"""``SeqMemDataModule``'s part in a checkpoint: the data signature it saves and checks, and how many train batches
Lightning has fetched ahead of the one it trains on (the stream loader saves those with its position).

Lightning restores the DataModule's state before it makes the train loader and restores the loader's position, so
a changed dataset or batching is refused (or the epoch restarted) before that position is used.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from lightning_seqmem.datamodule.read_mode import ReadMode


class ResumeHooks:
    """Mixed into ``SeqMemDataModule``: ``state_dict``/``load_state_dict`` (Lightning's DataModule hooks) and the
    loader's question of how far Lightning has fetched ahead."""

    read_mode: ReadMode | None
    _superseded: list[dict[str, Any]]

    def _ready(self) -> ReadMode:  # defined by the DataModule
        raise NotImplementedError

    def data_signature(self) -> dict[str, Any]:
        """What a saved loader position refers to: the settings that decide the train rows and their batches
        (``BatchingSettings.signature``; for conversations also which tokens carry loss), and a checksum of the
        train row lengths."""
        return self._ready().data_signature()

    def state_dict(self) -> dict[str, Any]:
        """Saved in Lightning checkpoints: the data signature, checked when a run resumes from it (a stream: what
        it had read, ``Streams.state_dict``)."""
        return {} if self.read_mode is None else self.read_mode.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Compare the checkpoint's data signature with this run's before the loader position is restored
        (Lightning restores the DataModule first): a changed dataset or batching makes that position meaningless.
        A checkpoint saved here before ``micro_batch_size`` was set (the batch-size finder restores the model it
        saved before its trials) restarts the epoch without a word: it holds no position of the rows now served."""
        if state_dict.get("data_signature") in self._superseded:
            self._ready().skip_resume_state = True  # map-style only: a stream's checkpoint has no signature
            return
        self._ready().load_state_dict(state_dict, rank_zero_warn)

    def _batches_fetched_ahead(self) -> int:
        """Train batches Lightning has fetched but not yet trained on (its fetcher keeps one ahead of a stream)."""
        fetcher = getattr(getattr(self.trainer, "fit_loop", None), "_data_fetcher", None)
        return len(getattr(fetcher, "batches", None) or ())
