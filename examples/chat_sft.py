"""Example 5: chat fine-tuning on your own conversations with your own tokenizer, loss on the assistant turns.

Conversations are lists of ``{"role", "content"}`` turns (``system``, ``user``, ``assistant``, ``tool``), given
here as a Python list (a ``datasets.Dataset``, or jsonl/parquet files with a ``messages`` column, work the same).
They are rendered with the tokenizer's chat template and tokenized once into the token cache; the assistant's
content and the tokens that close its turn carry loss (``train_on="assistant"``), so the model learns to stop.
A message with ``"train": False`` (or True) overrides that for one turn. Conversations over ``max_length`` lose
whole oldest turns first (the system message stays); packing keeps every conversation whole.

Your tokenizer: ``--tokenizer <directory of an instruct model's tokenizer>`` (its chat template is used; one with
``{% generation %}`` markers gives the mask directly, others are checked turn by turn). Offline, without one, the
built-in tokenizer stands in (it has a ChatML-style template with generation markers).

    python examples/chat_sft.py --max-steps 200 [--tokenizer path/to/tokenizer]
"""

import argparse
import os
import random

from lightning_seqmem.memory import configure_allocator

configure_allocator()  # before torch is imported

import lightning.pytorch as L  # noqa: E402

from lightning_seqmem import CausalLM, SeqMemDataModule  # noqa: E402
from lightning_seqmem.apps.summary import RunSummary  # noqa: E402
from lightning_seqmem.data.tokenizer import load_tokenizer  # noqa: E402
from lightning_seqmem.training.progress import StepProgressBar  # noqa: E402

COLOURS = ["red", "green", "blue", "yellow", "black", "white"]


def make_conversations(n: int = 400, seed: int = 0) -> list[list[dict]]:
    """Multi-turn chats about colour mixing; some start with a system message, some teach a turn not to train."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": "You are a terse painter."}] if i % 3 == 0 else []
        for _ in range(rng.randint(1, 5)):
            a, b = rng.sample(COLOURS, 2)
            turns.append({"role": "user", "content": f"What do I get when I mix {a} and {b}?"})
            turns.append({"role": "assistant", "content": f"Mixing {a} with {b} gives a {a}-{b} blend."})
        if i % 10 == 0:  # a greeting we do not want the model to learn: this turn carries no loss
            turns.insert(len(turns) - 1, {"role": "assistant", "content": "Hi!", "train": False})
            turns.insert(len(turns) - 1, {"role": "user", "content": "Go on."})
        out.append(turns)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory or name; default: the built-in one")
    parser.add_argument("--out", default="outputs/chat_sft")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    tokenizer = load_tokenizer(args.tokenizer)  # any Hugging Face tokenizer with a chat template
    dm = SeqMemDataModule(
        dataset=make_conversations(),
        tokenizer=tokenizer,
        max_length=256,
        micro_batch_size=8,
        strategy="pack",
        train_on="assistant",
    )
    dm.setup("fit")
    stats = dm.stats()["train"]
    print(
        f"conversations: {stats['documents']}, mask from {stats['mask_method']}, "
        f"{stats['trained_share']:.1%} of the tokens fed carry loss, token efficiency {stats['token_efficiency']:.1%}"
    )
    batch = next(iter(dm.train_dataloader()))
    row, labels = batch["input_ids"][0], batch["labels"][0]
    trained = tokenizer.decode(row[labels != -100][:40])
    print(
        f"first batch {tuple(batch['input_ids'].shape)}: {int((batch['position_ids'] == 0).sum())} segments; "
        f"trained text starts: {trained!r}"
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
