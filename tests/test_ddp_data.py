"""Two real processes (gloo, CPU): equal batch counts per rank, no document lost or duplicated, identical packing,
and TokenEfficiency synced exactly across ranks."""

import json
import os
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

STRATEGIES = {
    "pad": dict(strategy="pad"),
    "pad_grouped": dict(strategy="pad", group_by_length=True),
    "pad_budget": dict(strategy="pad", max_tokens_per_batch=96),
    "truncate": dict(strategy="truncate"),
    "pack": dict(strategy="pack"),
}


def _texts():
    return [f"doc {i} " + "word " * (1 + (i * 7) % 23) for i in range(37)]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import datasets

    from lightning_seqmem.datamodule import SeqMemDataModule
    from lightning_seqmem.metrics import TokenEfficiency

    result = {}
    for name, kwargs in STRATEGIES.items():
        dm = SeqMemDataModule(dataset=datasets.Dataset.from_dict({"text": _texts()}), max_length=24,
                              micro_batch_size=3, seed=7, **kwargs)
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
            "batches": batches, "len": len(loader), "rows": rows, "num_rows": len(dm._rows["train"]),
            "efficiency": metric.compute().item(), "local": local,
            "packed": dm._rows["train"].packed.input_ids.tolist() if name == "pack" else None,
        }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_see_every_document_once_in_the_same_number_of_batches(tmp_path, tokenizer):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    for name in STRATEGIES:
        a, b = r0[name], r1[name]
        assert a["batches"] == b["batches"] == a["len"] == b["len"] > 0, name  # no rank waits at epoch end
        assert sorted(a["rows"] + b["rows"]) == list(range(a["num_rows"])), name  # none lost or duplicated
        real = a["local"][0] + b["local"][0]
        slots = a["local"][1] + b["local"][1]
        assert a["efficiency"] == pytest.approx(real / slots) == b["efficiency"], name  # synced sums
    assert r0["pack"]["packed"] == r1["pack"]["packed"]  # identical packing on every rank
