"""A streamed dataset under Lightning's DDP or FSDP on two forked CPU ranks (gloo), run by ``test_streaming.py``.

The validation split has two files of very different sizes, so each rank's share packs into a different number of
rows. Under FSDP every forward is collective: a rank that ran out of validation batches first would leave the other
waiting forever. Each rank records how many validation batches it ran and its validation loss.
"""

import json
import os

import datasets
import lightning.pytorch as L
import torch
from _memory_cpu_fsdp import CPUFSDPStrategy

from lightning_seqmem import CausalLM, SeqMemDataModule


class CountingLM(CausalLM):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.val_batches = 0

    def validation_step(self, batch, batch_idx):
        self.val_batches += 1
        return super().validation_step(batch, batch_idx)


def _write(directory, name, count, words):
    path = os.path.join(directory, f"{name}.jsonl")
    with open(path, "w") as f:
        for i in range(count):
            f.write(json.dumps({"text": f"{name} {i} " + "word " * (1 + (i * 3) % words)}) + "\n")
    return path


def write_files(directory: str) -> dict[str, list[str]]:
    """The streams' files, written once before the ranks start: two train files, a big and a tiny validation file."""
    train = [_write(directory, f"train{s}", 40, 30) for s in range(2)]
    return {"train": train, "validation": [_write(directory, "val_big", 30, 30), _write(directory, "val_small", 2, 3)]}


def main(rank: int, kind: str, files: dict[str, list[str]]) -> dict:
    """One rank's run (``kind``: "ddp" or "fsdp") over ``write_files``'s files; returns its record."""
    stream = datasets.load_dataset("json", data_files=files, streaming=True)
    dm = SeqMemDataModule(dataset=stream, max_length=32, micro_batch_size=2, strategy="pack", streaming_buffer_size=4)
    model = CountingLM()
    strategy = CPUFSDPStrategy(process_group_backend="gloo") if kind == "fsdp" else "ddp"
    trainer = L.Trainer(
        max_steps=4,
        val_check_interval=2,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm)
    assert trainer.global_rank == rank
    torch.distributed.barrier()
    return {
        "val_batches": model.val_batches,
        "val_loss": float(trainer.callback_metrics["val/loss"]),
        "stats": dm.stats()["validation"],
    }
