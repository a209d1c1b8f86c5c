"""Two real processes (gloo, CPU): equal batch counts per rank, no document lost or duplicated, identical packing,
and TokenEfficiency synced exactly across ranks."""

import json
import multiprocessing as mp
import os

import datasets
import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from _forked_ranks import run_ranks
from lightning.pytorch.strategies import DDPStrategy

from lightning_seqmem.batching.options import Pad
from lightning_seqmem.datamodule.module import SeqMemDataModule
from lightning_seqmem.training.metrics import TokenEfficiency

STRATEGIES = {
    "pad": dict(strategy="pad"),
    "pad_grouped": dict(batching=Pad(group_by_length=True)),
    "pad_budget": dict(strategy="pad", max_tokens_per_batch=96),
    "truncate": dict(strategy="truncate"),
    "pack": dict(strategy="pack"),
}


def _texts():
    return [f"doc {i} " + "word " * (1 + (i * 7) % 23) for i in range(37)]


def _rank(rank: int) -> dict:
    """One of two forked ranks (``_forked_ranks``): every strategy's batches, rows and synced efficiency."""
    dist.init_process_group("gloo")  # rank, world size and rendezvous from the environment
    result = {}
    for name, kwargs in STRATEGIES.items():
        dm = SeqMemDataModule(
            dataset=datasets.Dataset.from_dict({"text": _texts()}), max_length=24, micro_batch_size=3, seed=7, **kwargs
        )
        dm.setup("fit")
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(1)
        metric = TokenEfficiency(pad_token_id=dm.pad_token_id)
        batches, rows = 0, []
        for indices, batch in zip(loader.sampler, loader):
            batches += 1
            rows.extend(indices)
            metric.update(batch)
        local = [metric.real_tokens.item(), metric.slots.item()]
        result[name] = {
            "batches": batches,
            "len": len(loader),
            "rows": rows,
            "num_rows": len(dm.read_mode.rows["train"]),
            "efficiency": metric.compute().item(),
            "local": local,
            "packed": dm.read_mode.rows["train"].packed.input_ids.tolist() if name == "pack" else None,
        }
    dist.destroy_process_group()
    return result


@pytest.mark.slow
def test_two_ranks_see_every_document_once_in_the_same_number_of_batches(tokenizer):
    r0, r1 = run_ranks(_rank)
    for name in STRATEGIES:
        a, b = r0[name], r1[name]
        assert a["batches"] == b["batches"] == a["len"] == b["len"] > 0, name  # no rank waits at epoch end
        assert sorted(a["rows"] + b["rows"]) == list(range(a["num_rows"])), name  # none lost or duplicated
        real = a["local"][0] + b["local"][0]
        slots = a["local"][1] + b["local"][1]
        assert a["efficiency"] == pytest.approx(real / slots) == b["efficiency"], name  # synced sums
    assert r0["pack"]["packed"] == r1["pack"]["packed"]  # identical packing on every rank


class _CountingModule(L.LightningModule):
    """Counts steps and rows on each rank and writes them out at the end of every epoch."""

    def __init__(self, out_dir: str):
        super().__init__()
        self.out_dir, self.steps, self.rows = out_dir, 0, 0
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        self.steps += 1
        self.rows += batch["input_ids"].shape[0]
        return (self.w * batch["input_ids"].float().mean()).sum()

    def on_train_epoch_end(self):
        sampler = self.trainer.train_dataloader.sampler
        record = {
            "steps": self.steps,
            "rows": self.rows,
            "sampler": type(sampler).__name__,
            "num_replicas": sampler.num_replicas,
            "epoch": sampler.epoch,
        }
        with open(os.path.join(self.out_dir, f"lightning_rank{self.global_rank}_epoch{sampler.epoch}.json"), "w") as f:
            json.dump(record, f)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.slow
def test_lightning_ddp_spawn_keeps_our_sampler_and_equal_steps(tmp_path, tokenizer):
    """Lightning's multiprocessing launcher (``ddp_spawn``'s), kept as the one such test of the library's own tests
    (the other multi-process tests fork their ranks, ``_forked_ranks``; ``test_sweep`` runs seqmem-train's launchers,
    ``ddp_spawn`` included, end to end): it proves that the DataModule, its rows and our sampler pickle into processes
    that never saw them, as they must on macOS and Windows and in notebooks. The ranks start by ``forkserver``: like
    ``spawn``, every object reaches them by pickle, but both fork from one server that imported torch and Lightning
    once (``set_forkserver_preload``) instead of each importing them again (~8 CPU-s). A tiny dataset and a
    one-parameter module."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["lightning.pytorch", "lightning_seqmem.datamodule.module", "datasets"])
    dm = SeqMemDataModule(
        dataset=datasets.Dataset.from_dict({"text": _texts()}),
        max_length=24,
        micro_batch_size=3,
        strategy="pack",
        seed=7,
    )
    trainer = L.Trainer(
        strategy=DDPStrategy(start_method="forkserver"),
        devices=2,
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(_CountingModule(str(tmp_path)), datamodule=dm)
    dm.setup("fit")
    rows_per_epoch = len(dm.read_mode.rows["train"])
    for epoch in (0, 1):  # Lightning calls set_epoch: the second epoch is reshuffled, not replayed
        ranks = [json.loads((tmp_path / f"lightning_rank{r}_epoch{epoch}.json").read_text()) for r in range(2)]
        assert all(r["sampler"] == "ShuffledBatchSampler" and r["num_replicas"] == 2 for r in ranks)  # not replaced
        assert ranks[0]["steps"] == ranks[1]["steps"]
        assert ranks[0]["rows"] + ranks[1]["rows"] == rows_per_epoch * (epoch + 1)  # every packed row, once
