"""Preference pairs benchmark: padded pairs (TRL's ``[2B, L]`` layout) against padding-free packed pairs.

The same ``datasets.Dataset`` of pre-tokenized pairs goes into ``SeqMemDataModule`` with each strategy; prompts and
completions have different log-normal lengths (prompts shorter, completions longer with a heavier tail, chosen and
rejected drawn apart), truncated as TRL's guide says (``max_prompt_length``, then ``max_length`` per sequence).

1. Token efficiency (real tokens / slots fed to the model, one epoch, ``dm.stats()``) on the whole set.
2. Throughput: the same pairs (a subset) through a DPO step each (policy forward + backward, reference forward,
   AdamW step) with a tiny Llama on CPU (one thread), each strategy in a fresh process; pairs and real tokens
   per CPU second (robust to a shared machine), wall seconds alongside.
   Both layouts compute the same per-pair log-probabilities (``tests/test_preference_packing.py``), so the work
   done per pair is the same; padding is the difference.

    python benchmarks/preference.py            # 20,000 pairs for efficiency, 256 through the model
    python benchmarks/preference.py --quick    # 4,000 and 64
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from lightning_seqmem import Pack, Pad, Truncate

STRATEGIES = {  # label -> DataModule arguments
    "pad (TRL layout)": {"batching": Pad()},
    "pad, group_by_length": {"batching": Pad(group_by_length=True)},
    "truncate ([2B, max_length])": {"batching": Truncate()},
    "pack (padding-free pairs)": {"batching": Pack()},
}
LIMITS = {"max_length": 512, "max_prompt_length": 192}
VOCAB = 4096


def pair_lengths(n: int, seed: int = 0) -> np.ndarray:
    """``[3, n]`` prompt, chosen and rejected lengths: log-normal, prompts median ~60 tokens, completions ~110 with
    a heavier tail (sigma 0.9), so a share of pairs is cut by max_length=512."""
    rng = np.random.default_rng(seed)
    prompt = rng.lognormal(np.log(60), 0.8, n)
    chosen = rng.lognormal(np.log(110), 0.9, n)
    rejected = rng.lognormal(np.log(90), 0.9, n)
    return np.clip(np.stack([prompt, chosen, rejected]).astype(np.int64), 1, 4096)


def write_dataset(path: Path, n: int, seed: int = 0) -> None:
    """Pre-tokenized pairs (random ids below ``VOCAB``) saved with ``save_to_disk``: every process reads the same."""
    import datasets

    lengths = pair_lengths(n, seed)
    rng = np.random.default_rng(seed + 1)
    columns = {
        name: [rng.integers(3, VOCAB, k, dtype=np.int32).tolist() for k in lengths[i]]
        for i, name in enumerate(("prompt_ids", "chosen_ids", "rejected_ids"))
    }
    datasets.Dataset.from_dict(columns).save_to_disk(str(path))


def module(path: str, arguments: dict, micro_batch_size: int):
    import datasets

    from lightning_seqmem import SeqMemDataModule

    dm = SeqMemDataModule(
        datasets.DatasetDict(
            train=datasets.load_from_disk(path), validation=datasets.load_from_disk(path).select(range(8))
        ),
        micro_batch_size=micro_batch_size,
        pad_token_id=0,
        **LIMITS,
        **arguments,
    )
    dm.setup("fit")
    return dm


def efficiency(path: str, label: str, micro_batch_size: int) -> dict:
    """One strategy's epoch statistics (the DataModule's own counts)."""
    dm = module(path, STRATEGIES[label], micro_batch_size)
    s = dm.stats()["train"]
    return {
        "strategy": label,
        "pairs": s["documents"],
        "efficiency": s["token_efficiency"],
        "batches": s["batches"],
        "shape": dm.max_batch_shape(),
        "truncated": s["tokens_truncated"] / s["tokens"],
    }


def throughput(path: str, label: str, micro_batch_size: int, pairs: int) -> dict:
    """DPO steps over the first ``pairs`` pairs (one epoch), in this process: pairs/s and real tokens/s."""
    import datasets
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_seqmem.batch import count_real_tokens
    from lightning_seqmem.training.preference_loss import dpo_loss, sequence_logps

    torch.manual_seed(0)
    torch.set_num_threads(1)  # one thread: CPU seconds measure the work even on a shared machine
    subset = str(Path(path).with_name(f"subset{pairs}"))
    if not Path(subset).exists():
        datasets.load_from_disk(path).select(range(pairs)).save_to_disk(subset)
    dm = module(subset, STRATEGIES[label], micro_batch_size)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        attn_implementation="sdpa",
    )
    policy, reference = LlamaForCausalLM(config), LlamaForCausalLM(config).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)

    def logits(model, batch):
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
        return model(**inputs, use_cache=False).logits

    batches = list(dm.train_dataloader())
    seen = real = 0
    start, cpu = time.perf_counter(), time.process_time()
    for batch in batches:
        with torch.no_grad():
            ref = sequence_logps(logits(reference, batch), batch)
        loss = dpo_loss(*sequence_logps(logits(policy, batch), batch), *ref).losses.mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seen += ref[0].numel()
        real += int(count_real_tokens(batch, 0))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {
        "strategy": label,
        "pairs": seen,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "pairs_per_s": seen / cpu,
        "real_tokens_per_s": real / cpu,
        "batches": len(batches),
    }


def fresh(kind: str, path: str, label: str, micro_batch_size: int, pairs: int = 0) -> dict:
    """Run one measurement in a new process (no allocator or cache state carried from another strategy)."""
    code = (
        f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import preference as b; "
        f"print(json.dumps(b.{kind}({path!r}, {label!r}, {micro_batch_size}"
        f"{', ' + str(pairs) if kind == 'throughput' else ''})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="pairs per padded batch, rows per packed")
    args = parser.parse_args()
    n, pairs = (4000, 64) if args.quick else (20000, 256)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "pairs")
        write_dataset(Path(path), n)
        print(
            f"{n:,} pairs, max_length={LIMITS['max_length']}, max_prompt_length={LIMITS['max_prompt_length']}, "
            f"micro_batch_size={args.micro_batch_size}\n"
        )
        print("| strategy | token efficiency | batches/epoch | largest batch | tokens truncated |")
        print("|---|---:|---:|---|---:|")
        for label in STRATEGIES:
            r = fresh("efficiency", path, label, args.micro_batch_size)
            print(
                f"| {label} | {r['efficiency']:.3f} | {r['batches']:,} | {tuple(r['shape'])} | {r['truncated']:.2%} |"
            )
        print(
            f"\nDPO steps (tiny Llama, CPU, one thread, policy + frozen reference), the same {pairs} pairs "
            "through each; per CPU second of the process (wall seconds vary with the machine's load):\n"
        )
        print("| strategy | batches | CPU seconds | wall seconds | pairs/s | real tokens/s |")
        print("|---|---:|---:|---:|---:|---:|")
        for label in STRATEGIES:
            r = fresh("throughput", path, label, args.micro_batch_size, pairs)
            print(
                f"| {label} | {r['batches']} | {r['cpu_seconds']:.1f} | {r['seconds']:.1f} | "
                f"{r['pairs_per_s']:.1f} | {r['real_tokens_per_s']:,.0f} |"
            )


if __name__ == "__main__":
    main()
