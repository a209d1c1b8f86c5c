"""Throughput benchmark: the tiny model trained on the same data with ``pad``, ``truncate`` and ``pack``.

Per strategy: real tokens/s, slots/s (real + padding), token efficiency and peak memory (RSS on CPU, allocated
on CUDA). Each strategy runs in a fresh subprocess so peak memory is its own. The target for ``pack``: real-token
throughput >= 0.9 x what removing the padding allows, i.e. ``pad real tok/s x (pad slots / pack slots)`` per real
token, which is ``pad slots/s`` when both run at the same slots/s.

    python benchmarks/throughput.py                  # 30 timed steps per strategy, max_length 256, 8 rows
    python benchmarks/throughput.py --steps 10 --max-length 128
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def worker(strategy: str, steps: int, max_length: int, rows: int, warmup: int) -> dict:
    import torch

    from lightning_seqmem import CausalLM, SeqMemDataModule
    from lightning_seqmem.batch import count_real_tokens
    from lightning_seqmem.summary import peak_memory_bytes

    torch.manual_seed(0)
    dm = SeqMemDataModule(max_length=max_length, micro_batch_size=rows, strategy=strategy, seed=0)
    dm.setup("fit")
    model = CausalLM(vocab_size=len(dm.tokenizer), pad_token_id=dm.pad_token_id)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    real = slots = 0
    elapsed = 0.0
    loader = iter(dm.train_dataloader())
    for step in range(warmup + steps):
        batch = {k: v.to(device) for k, v in next(loader).items()}
        start = time.perf_counter()
        loss = model(batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= warmup:
            elapsed += time.perf_counter() - start
            real += int(count_real_tokens(batch, dm.pad_token_id))
            slots += batch["input_ids"].numel()
    peak, _ = peak_memory_bytes(device)
    return {"strategy": strategy, "real_tok_s": real / elapsed, "slots_s": slots / elapsed, "efficiency": real / slots,
            "peak_mib": peak / 2**20, "lost": dm.stats()["train"]["tokens_truncated"] + dm.stats()["train"]["tokens_dropped"],
            "device": device.type}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.max_length, args.rows, args.warmup)))
        return
    results = {}
    for strategy in ("pad", "truncate", "pack"):
        cmd = [sys.executable, __file__, "--worker", strategy, "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--max-length", str(args.max_length), "--rows", str(args.rows)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results[strategy] = json.loads(out.strip().splitlines()[-1])
    print(f"max_length={args.max_length}, rows={args.rows}, {args.steps} timed steps, device={results['pad']['device']}")
    print("| strategy | real tokens/s | slots/s | token efficiency | tokens lost (train) | peak memory (MiB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results.values():
        print(f"| {r['strategy']} | {r['real_tok_s']:,.0f} | {r['slots_s']:,.0f} | {r['efficiency']:.3f} | "
              f"{r['lost']:,} | {r['peak_mib']:,.0f} |")
    pad, pack = results["pad"], results["pack"]
    # Removing the padding turns every padded slot into a real one at the same per-slot cost.
    allowed = pad["real_tok_s"] / pad["efficiency"] * pack["efficiency"]
    print(f"\npack real tokens/s = {pack['real_tok_s']:,.0f}; padding-free bound from pad = {allowed:,.0f}; "
          f"ratio {pack['real_tok_s'] / allowed:.2f} (target >= 0.9)")


if __name__ == "__main__":
    main()
