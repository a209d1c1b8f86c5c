"""The train stream's loader: torchdata's ``StatefulDataLoader`` over :class:`StreamingRows`, with what it lacks
for a Lightning run: the batches fetched ahead, every rank's position, and a resume with other readers.

- **Fetched ahead.** Lightning fetches one batch ahead of the one it trains on when a loader has no length (a
  stream): at a checkpoint the loader has yielded a batch that was never trained on. ``lookahead`` (given by the
  DataModule) says how many; those batches are saved with the position and yielded first on resume.
- **Every rank.** Lightning writes rank 0's checkpoint, and each rank reads its own share of the stream: the
  positions of all ranks are gathered into it (``state_dict`` is a collective under DDP/FSDP, as checkpointing is).
- **Other readers.** torchdata resumes only the same number of workers. With another number of workers or ranks,
  the saved readers are dealt out anew (``rows.Regrouped``): no document lost or read twice in the epoch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_seqmem.messages import spell_data_option

_SNAPSHOT, _WORKERS = "_snapshot", "_worker_snapshots"
_DATASET_STATE = "dataset_state"  # torchdata's key of a dataset's state, in the main process and in a worker's

__all__ = ["ResumePolicy", "StreamingLoader", "reader_states"]


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@dataclass(frozen=True)
class ResumePolicy:
    """How a stream's train loader resumes, decided by the DataModule before the loader is built.

    Attributes:
        on_mismatch: ``on_resume_mismatch``: a position it cannot deal to this run's readers is refused
            (``"error"``) or the epoch restarts (``"restart_epoch"``, said through ``warn``).
        warn: where that warning goes.
        restart: the checkpoint's data differ (the DataModule's signature check): start the epoch afresh.
        lookahead: how many batches were yielded but not yet trained on (Lightning fetches ahead of a stream).
    """

    on_mismatch: str = "error"
    warn: Callable[[str], None] = print
    restart: bool = False
    lookahead: Callable[[], int] | None = None


class StreamingLoader(StatefulDataLoader):
    """A ``StatefulDataLoader`` over :class:`StreamingRows` (or ``MixedRows``) that moves the stream's epoch on each
    time it is iterated (Lightning sets epochs on samplers only, and a stream has none), and resumes by the policy it
    is built with.

    Args:
        dataset: the rows (``set_epoch``; ``regroup`` where saved readers can be dealt to other ones).
        policy: how it resumes (:class:`ResumePolicy`), given when it is built.
        gather: every rank's position in the state (a collective); ``False`` for one rank's own.
    """

    def __init__(self, dataset, *args, policy: ResumePolicy | None = None, gather: bool = True, **kwargs) -> None:
        super().__init__(dataset, *args, **kwargs)
        self.epochs_started = 0
        self.policy = policy if policy is not None else ResumePolicy()
        self.gather = gather
        self._recent: deque = deque(maxlen=8)
        self._pending: list = []  # batches to yield first: fetched ahead of the checkpoint this run resumed from
        self._resuming = False  # the next iteration goes on with the epoch a checkpoint was in

    def __iter__(self):
        if not self._resuming:
            self.dataset.set_epoch(self.epochs_started)  # before the workers copy the dataset
            self.epochs_started += 1
        pending, self._pending, self._resuming = self._pending, [], False
        for batch in pending:
            self._recent.append(batch)
            yield batch
        for batch in super().__iter__():
            self._recent.append(batch)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """This rank's position (torchdata's, whose workers' states are :class:`StreamingRows`'), the batches it
        yielded ahead of training, the epoch; under DDP/FSDP every rank's, gathered (call it on every rank)."""
        ahead = self.policy.lookahead() if self.policy.lookahead is not None else 0
        mine = {
            "loader": super().state_dict(),
            "ahead": list(self._recent)[len(self._recent) - ahead :] if ahead else [],
            "epochs_started": self.epochs_started,
            "workers": self.num_workers,
        }
        rank, world = _world()
        if world == 1 or not self.gather:
            return {"ranks": [mine]}
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine)
        return {"ranks": everyone}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume exactly with the same readers; deal the saved readers out again with other ones."""
        ranks = state_dict.get("ranks")
        if not ranks or self.policy.restart:
            return
        rank, world = _world()
        same = len(ranks) == world and all(r["workers"] == self.num_workers for r in ranks)
        if same:
            mine = ranks[rank]
            self.epochs_started = mine["epochs_started"]
            self.dataset.set_epoch(max(0, self.epochs_started - 1))
            self._pending = list(mine["ahead"])
            self._resuming = not mine["loader"].get("_iterator_finished", False)
            super().load_state_dict(mine["loader"] if self._resuming else {})
            return
        if not hasattr(self.dataset, "regroup"):  # a mix of streams: its order is per reader
            self._refuse(
                f"Cannot resume this checkpoint's mix of streams with {self.num_workers} loader worker(s) on {world} "
                f"rank(s): it was saved with {ranks[0]['workers']} on {len(ranks)}, and a mix's order is decided by "
                "each reader.",
                f"Resume with num_workers={ranks[0]['workers']} on {len(ranks)} rank(s)",
            )
            return
        readers = [reader for saved in ranks for reader in reader_states(saved["loader"], saved["workers"])]
        if not self._can_regroup(readers, len(ranks), world):
            return
        self.epochs_started = ranks[0]["epochs_started"]
        self.dataset.set_epoch(max(0, self.epochs_started - 1))
        self.dataset.regroup(readers)
        self._pending = [b for j, saved in enumerate(ranks) if j % world == rank for b in saved["ahead"]]
        self.next_iter_state, self._resuming = None, True

    def _can_regroup(self, readers: list[dict[str, Any]], saved_world: int, world: int) -> bool:
        """Whether positions saved with ``saved_world`` ranks can be dealt to ``world``: each shard must have been
        one rank's (a stream whose shards do not divide by the ranks is read by every rank, each keeping its
        ``world``-th documents, and such positions mean nothing for another world size)."""
        shards = {r["layout"]["shards"] for r in readers if r.get("layout")}
        whole = all(n % saved_world == 0 and n % world == 0 for n in shards)
        if whole or saved_world == world:
            return True
        self._refuse(
            f"Cannot deal this checkpoint's stream position to {world} rank(s): it was saved by {saved_world}, and "
            f"the stream's {sorted(shards)} shard(s) cannot be dealt whole to both, so each rank read every shard "
            "and kept its own share of the documents.",
            f"Resume with {saved_world} rank(s), give the stream a number of files that both world sizes divide",
        )
        return False

    def _refuse(self, message: str, fix: str) -> None:
        """Raise (``on_resume_mismatch="error"``) or warn that the epoch restarts (``"restart_epoch"``)."""
        restart = spell_data_option("on_resume_mismatch", "restart_epoch")
        if self.policy.on_mismatch == "error":
            raise ValueError(
                f"{message} {fix}, or pass {restart} to keep the model and optimizer and start the epoch afresh."
            )
        self.policy.warn(f"{message} The current epoch restarts from its first batch ({restart}).")


def reader_states(loader_state: dict[str, Any], workers: int) -> list[dict[str, Any]]:
    """Each reader's :class:`StreamingRows` state in a torchdata loader state, by worker."""
    if workers == 0:
        return [loader_state.get(_DATASET_STATE) or {"fresh": True}]
    snapshots = loader_state[_SNAPSHOT][_WORKERS]
    return [(snapshots[f"worker_{w}"] or {}).get(_DATASET_STATE) or {"fresh": True} for w in range(workers)]
