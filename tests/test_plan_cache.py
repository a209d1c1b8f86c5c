"""Packing plans on disk: planned once per node, mapped by every later rank and run, never stale."""

import datasets
import lightning.pytorch as L
import numpy as np
import pyarrow as pa
import pytest
import torch
from _forked_ranks import run_ranks

from lightning_seqmem import SeqMemDataModule
from lightning_seqmem.batching import plan_cache
from lightning_seqmem.batching.packed_rows import pack_lengths
from lightning_seqmem.batching.plan_cache import PLAN_CACHE_MIN_DOCUMENTS, cached_pack_lengths

N_DOCS = PLAN_CACHE_MIN_DOCUMENTS + 10_000


def _lengths(n=N_DOCS, seed=0, longest=700):
    return np.random.default_rng(seed).integers(0, longest, n)


def _same_plan(a, b):
    for name in ("segment_doc", "segment_start", "segment_length", "seg_row_offsets"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert a.stats() == b.stats()


def _no_planning(monkeypatch):
    def refuse(lengths, *args, **kwargs):
        if len(lengths) >= PLAN_CACHE_MIN_DOCUMENTS:  # smaller ones are planned in memory, every time
            raise AssertionError("planned again although the plan is on disk")
        return pack_lengths(lengths, *args, **kwargs)

    monkeypatch.setattr(plan_cache, "pack_lengths", refuse)


def test_a_plan_is_written_once_then_mapped(tmp_path, monkeypatch):
    lengths = _lengths()
    first = cached_pack_lengths(lengths, 512, "bfd", "split", tmp_path)
    _same_plan(first, pack_lengths(lengths, 512, "bfd", "split"))
    assert len(list((tmp_path / "plans").iterdir())) == 1
    _no_planning(monkeypatch)
    again = cached_pack_lengths(lengths.copy(), 512, "bfd", "split", tmp_path)
    assert isinstance(again.segment_doc, np.memmap) and not again.segment_doc.flags.writeable
    _same_plan(again, first)


@pytest.mark.parametrize("change", ["one_length", "max_length", "overflow", "packing"])
def test_any_change_to_lengths_or_settings_plans_again(tmp_path, change):
    lengths = _lengths(longest=1200)
    cached_pack_lengths(lengths, 1024, "bfd", "split", tmp_path)
    args = {"lengths": lengths.copy(), "max_length": 1024, "packing": "bfd", "overflow": "split"}
    if change == "one_length":
        args["lengths"][123] += 1
    elif change == "max_length":
        args["max_length"] = 1000
    elif change == "overflow":
        args["overflow"] = "truncate"
    else:
        args["packing"] = "wrapped"
    got = cached_pack_lengths(cache_dir=tmp_path, **args)
    _same_plan(got, pack_lengths(**args))
    assert len(list((tmp_path / "plans").iterdir())) == 2


def test_a_damaged_plan_is_planned_again(tmp_path):
    lengths = _lengths()
    cached_pack_lengths(lengths, 512, cache_dir=tmp_path)
    (directory,) = (tmp_path / "plans").iterdir()
    (directory / "segment_length.npy").write_bytes(b"not an array")
    _same_plan(cached_pack_lengths(lengths, 512, cache_dir=tmp_path), pack_lengths(lengths, 512))


def test_a_cache_dir_that_cannot_be_written_still_gives_the_plan(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    lengths = _lengths()
    _same_plan(cached_pack_lengths(lengths, 512, cache_dir=blocked), pack_lengths(lengths, 512))


def test_a_rank_that_loses_the_race_leaves_no_staging_files(tmp_path):
    lengths = _lengths()
    plan = pack_lengths(lengths, 512)
    directory = tmp_path / "plans" / plan_cache.plan_key(lengths, 512, "bfd", "split")
    plan_cache._save(plan, directory)
    with pytest.raises(OSError):
        plan_cache._save(plan, directory)  # the directory is there: the second rename fails
    assert [p.name for p in (tmp_path / "plans").iterdir()] == [directory.name]
    _same_plan(cached_pack_lengths(lengths, 512, cache_dir=tmp_path), plan)


def test_small_datasets_and_no_cache_dir_plan_in_memory(tmp_path):
    cached_pack_lengths(_lengths(n=1000), 512, cache_dir=tmp_path)
    cached_pack_lengths(_lengths(), 512, cache_dir=None)
    assert not (tmp_path / "plans").exists()


def _pretokenized(n=N_DOCS, seed=0):
    lengths = np.random.default_rng(seed).integers(1, 120, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    flat = np.random.default_rng(seed + 1).integers(3, 1000, int(offsets[-1])).astype(np.int32)
    return datasets.Dataset(pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))}))


def _module(ds, cache_dir):
    return SeqMemDataModule(
        dataset=ds,
        strategy="pack",
        max_length=256,
        micro_batch_size=4,
        pad_token_id=0,
        eos_token_id=2,
        cache_dir=cache_dir,
        seed=3,
    )


def test_prepare_data_plans_and_another_rank_maps_the_same_rows(tmp_path, monkeypatch):
    """What local rank 0 (prepare_data) and another rank (setup only) see: the same rows and batches, and the
    second never plans."""
    ds = _pretokenized()
    rank0 = _module(ds, tmp_path)
    rank0.prepare_data()
    assert rank0.datasets is not None and len(list((tmp_path / "plans").iterdir())) == 1  # the train split
    _no_planning(monkeypatch)
    other = _module(ds, tmp_path)
    other.setup("fit")
    assert other.stats() == rank0.stats()
    assert other.stats()["train"]["tokens_truncated"] == 0 and other.stats()["train"]["token_efficiency"] > 0.99
    for a, b in zip(rank0.train_dataloader(), other.train_dataloader()):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


class _PlanSource(L.LightningModule):
    """Notes, per rank, whether its train rows were planned in this process or mapped from the plan on disk."""

    def __init__(self, out_dir: str):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.out_dir = out_dir

    def on_train_start(self):
        packed = self.trainer.datamodule.read_mode.rows["train"].packed
        with open(f"{self.out_dir}/rank{self.global_rank}.txt", "w") as f:
            f.write(type(packed.segment_doc).__name__)

    def training_step(self, batch, batch_idx):
        return (self.w * batch["input_ids"].float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit_on_rank(rank, dm, tmp_path):
    """One of two forked ranks (``_forked_ranks``) under Lightning's DDP: prepare_data on local rank 0 only."""
    trainer = L.Trainer(
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(_PlanSource(str(tmp_path)), datamodule=dm)
    assert trainer.global_rank == rank


@pytest.mark.slow
def test_two_ranks_plan_once_per_node(tmp_path):
    dm = _module(_pretokenized(), tmp_path / "cache")
    run_ranks(_fit_on_rank, dm, tmp_path)
    seen = {rank: (tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)}
    assert seen == {0: "ndarray", 1: "memmap"}  # local rank 0 planned in prepare_data; rank 1 mapped its plan
    assert len(list((tmp_path / "cache" / "plans").iterdir())) == 1
