"""Example 5: DPO on preference pairs, padded in TRL's layout or packed without padding.

The built-in preference set (the built-in corpus's answers against shuffled or truncated ones; any data with
``prompt``/``chosen``/``rejected`` columns, or ``prompt_ids``/``chosen_ids``/``rejected_ids``, works the same) is
truncated as TRL's guide says and batched two ways: ``--strategy pad`` gives ``[2B, L]`` batches (chosen rows,
then rejected rows, with ``completion_mask``: what TRL's ``DataCollatorForPreference`` gives), ``--strategy pack``
packs whole pairs into rows of ``2 * max_length`` with ``sequence_index``. ``DPO`` trains the sigmoid loss against
a frozen copy of the policy; the same loss code reads both layouts.

``--chat`` gives the same pairs as conversations (the prompt a user turn, each answer an assistant turn), rendered
with the tokenizer's chat template as TRL's ``DPOTrainer`` renders them (the built-in tokenizer has a ChatML-style
template; pass your own tokenizer with one).

    python examples/dpo.py --max-steps 50 --strategy pack
    python examples/dpo.py --max-steps 50 --chat

The built-in pairs have a long tail: 1.6 % of them hold over a third of the tokens (answers of up to 15,000 tokens).
Cut to ``max_length``, those answers would train without their end and most of their tokens (48 % of the training
tokens at ``max_length=128``, still 28 % at 1024). So the pairs that do not fit in ``--max-length`` (384 by
default: 95 % of the pairs fit) are left out before training, counted and printed, and the DataModule reports what
it still truncates.
"""

import argparse
import os

from lightning_seqmem.memory import configure_allocator

configure_allocator()  # before torch is imported

import lightning.pytorch as L  # noqa: E402

from lightning_seqmem import DPO, SeqMemDataModule  # noqa: E402
from lightning_seqmem.apps.summary import RunSummary  # noqa: E402
from lightning_seqmem.data.preference_corpus import load_builtin_preference_corpus  # noqa: E402
from lightning_seqmem.data.tokenizer import load_tokenizer  # noqa: E402
from lightning_seqmem.training.progress import StepProgressBar  # noqa: E402

TEMPLATE_TOKENS = 16  # room for special and chat-template tokens around prompt and answer


def fits(pairs, max_length: int):
    """The pairs whose prompt and longer answer fit in ``max_length`` tokens of the built-in tokenizer, and a line
    saying how many of each split were left out."""
    tokenizer = load_tokenizer()

    def length(batch):
        n = {k: [len(ids) for ids in tokenizer(batch[k], add_special_tokens=False)["input_ids"]] for k in batch}
        return {"pair_length": [p + max(c, r) for p, c, r in zip(n["prompt"], n["chosen"], n["rejected"])]}

    measured = pairs.map(length, batched=True)
    kept = measured.filter(lambda n: n + TEMPLATE_TOKENS <= max_length, input_columns="pair_length")
    left = ", ".join(f"{split} {len(measured[split]) - len(kept[split])} of {len(measured[split])}" for split in kept)
    return kept.remove_columns("pair_length"), f"pairs longer than max_length={max_length} left out: {left}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--strategy", choices=["pad", "truncate", "pack"], default="pack")
    parser.add_argument("--max-length", type=int, default=384)
    parser.add_argument("--chat", action="store_true", help="the pairs as conversations (chat template)")
    parser.add_argument("--out", default="outputs/dpo")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    data, left_out = fits(load_builtin_preference_corpus(), args.max_length)
    print(left_out)
    if args.chat:  # {"prompt": [user turn], "chosen": [assistant turn], "rejected": [assistant turn]} per pair

        def as_turns(pair: dict) -> dict:
            return {
                "prompt": [{"role": "user", "content": pair["prompt"]}],
                **{side: [{"role": "assistant", "content": pair[side]}] for side in ("chosen", "rejected")},
            }

        data = data.map(as_turns)
    dm = SeqMemDataModule(
        data,
        max_length=args.max_length,
        micro_batch_size=4,
        strategy=args.strategy,
        max_prompt_length=args.max_length // 4,
    )
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    stats = dm.stats()["train"]
    print(
        f"first batch {tuple(batch['input_ids'].shape)} ({', '.join(batch)}); {stats['documents']} pairs, "
        f"{stats['tokens_truncated'] + stats['tokens_dropped']:,} of {stats['tokens']:,} tokens truncated or "
        "dropped, token efficiency "
        f"{stats['token_efficiency']:.3f}"
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
    trainer.fit(DPO(beta=0.1, learning_rate=5e-4), datamodule=dm)
    print({k: round(float(v), 4) for k, v in trainer.callback_metrics.items() if "reward" in k or "loss" in k})
