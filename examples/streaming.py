"""Example 7: train on files read as a stream: nothing tokenized or converted ahead, memory bounded by a window.

Four jsonl files stand in for a large corpus (``--files`` of them; a hub dataset name works the same). With
``streaming=True`` the DataModule reads them as a ``datasets`` stream: ``datasets`` deals whole files to the loader
workers (and, under DDP, to the ranks), each document is tokenized and packed as it is read, and ``stats()`` counts
what has been read and every token ``max_length`` took. The first ``streaming_validation_documents`` validate.

    python examples/streaming.py --max-steps 200
    python examples/streaming.py --max-steps 200 --devices 2     # DDP on 2 CPU processes: a share of files each
"""

import argparse
import json
import os
import random

from lightning_seqmem.memory import configure_allocator

configure_allocator()  # before torch is imported

import lightning.pytorch as L  # noqa: E402

from lightning_seqmem import CausalLM, SeqMemDataModule  # noqa: E402
from lightning_seqmem.apps.summary import RunSummary  # noqa: E402
from lightning_seqmem.training.progress import StepProgressBar  # noqa: E402


def write_files(directory: str, files: int = 4, documents: int = 2000, seed: int = 0) -> list[str]:
    """``files`` jsonl files of short stories of varied length (one ``text`` column)."""
    rng = random.Random(seed)
    words = [
        "the",
        "a",
        "cat",
        "dog",
        "sat",
        "ran",
        "over",
        "under",
        "quickly",
        "slowly",
        "home",
        "tree",
        "river",
        "bird",
        "sang",
    ]
    paths = [os.path.join(directory, f"part-{f}.jsonl") for f in range(files)]
    for _f, path in enumerate(paths):
        with open(path, "w") as out:
            for _ in range(documents // files):
                out.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(5, 400)))}) + "\n")
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--out", default="outputs/streaming")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    dm = SeqMemDataModule(
        dataset=write_files(args.out, args.files),
        streaming=True,
        strategy="pack",
        max_length=256,
        micro_batch_size=8,
        num_workers=2,
        streaming_buffer_size=256,
        streaming_validation_documents=64,
    )
    trainer = L.Trainer(
        max_steps=args.max_steps,
        val_check_interval=max(1, args.max_steps // 2),
        accelerator="cpu",
        devices=args.devices,
        callbacks=[RunSummary(), StepProgressBar()],  # counts optimizer steps; plain lines in a log file
        default_root_dir=args.out,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(CausalLM(learning_rate=2e-3), datamodule=dm)
    if trainer.global_rank == 0:
        train = dm.stats()["train"]
        print(
            f"stream read so far (rank 0): {train['documents']:,} documents, {train['tokens']:,} tokens, "
            f"{train['documents_split']:,} split at max_length, "
            f"{train['tokens_truncated'] + train['tokens_dropped']:,} tokens lost"
        )
