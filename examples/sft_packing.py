"""Example 4: supervised fine-tuning on prompt/completion data, packed, with the loss on completions only.

A small arithmetic prompt/completion set is generated as JSON lines (any data with ``prompt`` and ``completion``
works the same). Packing puts several examples in each row; ``position_ids`` restart for every example so none
attends to another; the prompt tokens get label -100, so only completions are learned.

The rows are built from the package's pure core (``pack_sequences``, ``PackCollator``): the prompt/completion
loss mask is packed with the same lengths as the tokens, so it lands in the same places.

    python examples/sft_packing.py --max-steps 200
"""
import argparse
import json
import os
import random

from lightning_seqmem.memory import configure_allocator

configure_allocator()  # before torch is imported

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_seqmem import CausalLM, PackCollator, RunSummary, load_tokenizer, pack_sequences  # noqa: E402


def write_dataset(path: str, rows: int = 600, seed: int = 0) -> str:
    """Prompt/completion pairs of varied length: ``"Q: 12 + 7 + 30 = ?\\nA:"`` -> ``" 49"``."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            terms = [rng.randint(0, 99) for _ in range(rng.randint(2, 12))]
            f.write(json.dumps({"prompt": f"Q: {' + '.join(map(str, terms))} = ?\nA:", "completion": f" {sum(terms)}"}) + "\n")
    return path


class PackedSFTData(L.LightningDataModule):
    """Prompt/completion JSON lines -> packed ``[batch, max_length]`` rows with completion-only labels."""

    def __init__(self, path: str, max_length: int = 128, micro_batch_size: int = 8) -> None:
        super().__init__()
        self.path, self.max_length, self.micro_batch_size = path, max_length, micro_batch_size
        self.tokenizer = load_tokenizer(None)  # CausalLM reads vocab size and pad id from here
        self.pad_token_id = self.tokenizer.pad_token_id
        self.collate = PackCollator(self.pad_token_id, max_length)

    def _pack(self, records: list[dict]) -> list[dict]:
        ids, loss_mask = [], []
        for r in records:
            prompt = self.tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
            completion = self.tokenizer(r["completion"], add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            ids.append(prompt + completion)
            loss_mask.append([0] * len(prompt) + [1] * len(completion))
        rows = pack_sequences(ids, self.max_length)  # best-fit decreasing: fewest rows
        masks = pack_sequences(loss_mask, self.max_length)  # same lengths -> same placement
        return [dict(rows.row(i), loss_mask=masks.row(i)["input_ids"]) for i in range(rows.num_rows)]

    def setup(self, stage: str) -> None:
        with open(self.path) as f:
            records = [json.loads(line) for line in f]
        cut = len(records) // 10
        self.val, self.train = self._pack(records[:cut]), self._pack(records[cut:])

    def _collate(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        batch = self.collate(examples)  # input_ids, labels, position_ids: [batch, max_length]
        for i, ex in enumerate(examples):
            prompt = torch.tensor(ex["loss_mask"]) == 0
            batch["labels"][i, : prompt.numel()][prompt] = -100
        return batch

    def train_dataloader(self):
        return DataLoader(self.train, self.micro_batch_size, shuffle=True, collate_fn=self._collate)

    def val_dataloader(self):
        return DataLoader(self.val, self.micro_batch_size, collate_fn=self._collate)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--out", default="outputs/sft_packing")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    dm = PackedSFTData(write_dataset(os.path.join(args.out, "arithmetic.jsonl")))
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    print(f"first batch {tuple(batch['input_ids'].shape)}: {int((batch['position_ids'] == 0).sum())} segments, "
          f"{int((batch['labels'] != -100).sum())} of {batch['labels'].numel()} tokens carry loss (completions)")

    trainer = L.Trainer(max_steps=args.max_steps, val_check_interval=max(1, args.max_steps // 2),
                        limit_val_batches=4, callbacks=[RunSummary()], default_root_dir=args.out,
                        enable_checkpointing=False, logger=False)
    trainer.fit(CausalLM(learning_rate=2e-3), datamodule=dm)
