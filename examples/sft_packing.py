"""Example 4: supervised fine-tuning on prompt/completion data, packed, with the loss on completions only.

A small arithmetic prompt/completion set is generated as JSON lines (any data with ``prompt`` and ``completion``
works the same). Packing puts several examples in each row; ``position_ids`` restart for every example so none
attends to another; the prompt tokens get label -100, so only completions are learned.

    python examples/sft_packing.py --max-steps 200
"""

import argparse
import json
import os
import random

from lightning_seqmem.memory import configure_allocator

configure_allocator()  # before torch is imported

import lightning.pytorch as L  # noqa: E402

from lightning_seqmem import CausalLM, Pack, SeqMemDataModule  # noqa: E402
from lightning_seqmem.apps.summary import RunSummary  # noqa: E402
from lightning_seqmem.training.progress import StepProgressBar  # noqa: E402


def write_dataset(path: str, rows: int = 600, seed: int = 0) -> str:
    """Prompt/completion pairs of varied length: ``"Q: 12 + 7 + 30 = ?\\nA:"`` -> ``" 49"``."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            terms = [rng.randint(0, 99) for _ in range(rng.randint(2, 12))]
            f.write(
                json.dumps({"prompt": f"Q: {' + '.join(map(str, terms))} = ?\nA:", "completion": f" {sum(terms)}"})
                + "\n"
            )
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--out", default="outputs/sft_packing")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    dm = SeqMemDataModule(
        dataset=write_dataset(os.path.join(args.out, "arithmetic.jsonl")),
        max_length=128,
        micro_batch_size=8,
        batching=Pack(method="bfd"),  # best-fit decreasing: examples kept whole, fewest rows
        completion_only_loss=True,
    )
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    print(
        f"first batch {tuple(batch['input_ids'].shape)}: {int((batch['position_ids'] == 0).sum())} segments, "
        f"{int((batch['labels'] != -100).sum())} of {batch['labels'].numel()} tokens carry loss (completions)"
    )

    trainer = L.Trainer(
        max_steps=args.max_steps,
        val_check_interval=max(1, args.max_steps // 2),
        limit_val_batches=4,
        callbacks=[RunSummary(), StepProgressBar()],  # counts optimizer steps; plain lines in a log file
        default_root_dir=args.out,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(CausalLM(learning_rate=2e-3), datamodule=dm)
