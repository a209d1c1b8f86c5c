"""What a user drops is freed when its last name goes, not when the cyclic garbage collector next runs: a
DataModule stops its loader workers at once, and a model releases its weights (on a GPU, its memory).

A reference cycle (Lightning's ``save_hyperparameters`` frame, a read mode asking the DataModule for its tokenizer)
used to keep both alive until a collection. For loader workers read outside a Trainer that collection could also
be slow: in this suite the collector closed the workers' queues before asking them to stop, and each was waited for
5 s, then killed (10 s per dropped DataModule with two workers). The collector is off in these tests, so only
reference counting can free anything."""

from __future__ import annotations

import gc
import multiprocessing
import time
import weakref

import pytest
from test_read_matrix import MODES, _dm

from lightning_seqmem import CausalLM
from lightning_seqmem.training.dpo import DPO


@pytest.fixture
def no_cyclic_collector():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def _live_children(before: set, wait: float) -> set:
    deadline = time.monotonic() + wait
    while (live := {p.pid for p in multiprocessing.active_children()} - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return live


@pytest.mark.parametrize("read,sources", MODES)
def test_a_dropped_datamodule_stops_its_loader_workers_at_once(read, sources, tmp_path, no_cyclic_collector):
    before = {p.pid for p in multiprocessing.active_children()}
    dm = _dm(read, sources, tmp_path, num_workers=2)
    loader = dm.train_dataloader()
    it = iter(loader)
    batches = [next(it) for _ in range(2)]
    assert len(_live_children(before, 0)) == 2, "two loader workers while reading"
    freed = weakref.ref(dm)
    del dm, loader, it
    assert freed() is None, "the DataModule outlived its last name"
    start = time.monotonic()
    assert not _live_children(before, 3.0), "loader workers outlived their DataModule"
    assert time.monotonic() - start < 1.0 and batches


@pytest.mark.parametrize("cls", [CausalLM, DPO])
def test_a_dropped_model_is_freed_at_once(cls, no_cyclic_collector):
    model = cls()
    assert model.hparams  # saved through Lightning, as before
    freed = weakref.ref(model)
    del model
    assert freed() is None
