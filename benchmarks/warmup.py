"""Sequence-length warmup benchmark: time and tokens to reach the no-warmup run's final validation loss.

Trains ``CausalLM`` on the built-in corpus (``SeqMemDataModule``) once per warmup ``duration`` (0 = no warmup,
the baseline) with the same seed, data order and number of optimizer steps, validating every ``--val-every``
steps. For each run it reports the first validation at which the loss is at or below the baseline's final loss:
training time (forward, backward and optimizer; data loading and validation excluded) and real tokens trained
on up to then, and the speed-up over the baseline.

    python benchmarks/warmup.py --quick
    python benchmarks/warmup.py --durations 0.3 0.6 --modes truncate reshape --max-steps 300 --max-length 256
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from lightning_seqmem import CausalLM, SeqLengthWarmup, SeqMemDataModule

# "micro" is small enough for a CPU smoke run; other names are CausalLM presets ("tiny_llama", "tiny_gpt2").
MODELS: dict[str, Any] = {
    "micro": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
    },
}


class Progress(Callback):
    """Training time, real tokens and validation loss at every validation."""

    def __init__(self) -> None:
        self.train_time = 0.0
        self._start = 0.0
        self.points: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train_time += time.perf_counter() - self._start

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or "val/loss" not in trainer.callback_metrics:
            return
        self.points.append(
            {
                "step": trainer.global_step,
                "time": self.train_time,
                "tokens": pl_module.real_tokens_seen,
                "val_loss": float(trainer.callback_metrics["val/loss"]),
            }
        )


def run(duration: float, truncate: bool, args: argparse.Namespace) -> list[dict[str, float]]:
    seed_everything(args.seed, workers=True)
    torch.set_num_threads(args.threads)
    dm = SeqMemDataModule(
        strategy="pad", max_length=args.max_length, micro_batch_size=args.micro_batch_size, seed=args.seed
    )
    progress = Progress()
    callbacks: list[Callback] = [progress]
    if duration > 0:
        callbacks.insert(
            0,
            SeqLengthWarmup(
                duration=duration,
                min_seq_length=args.min_seq_length,
                max_seq_length=args.max_length,
                step_size=8,
                truncate=truncate,
            ),
        )
    model = CausalLM(model_config=MODELS.get(args.model, args.model), learning_rate=args.lr)
    trainer = Trainer(
        accelerator="auto",
        devices=1,
        max_steps=args.max_steps,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,
        limit_val_batches=args.val_batches,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, datamodule=dm)
    return progress.points


def time_to_target(points: list[dict[str, float]], target: float) -> dict[str, float] | None:
    return next((p for p in points if p["val_loss"] <= target + 1e-9), None)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--durations", type=float, nargs="+", default=[0.3, 0.6], help="0 (baseline) always runs")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--min-seq-length", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--val-every", type=int, default=20)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--model", default="tiny_llama")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["truncate", "reshape"],
        default=["truncate", "reshape"],
        help="truncate (Composer's default) and/or reshape (keeps every token)",
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--quick", action="store_true", help="smoke run: micro model, 40 steps, length 128, 0/0.3")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_steps, args.max_length, args.val_every, args.val_batches, args.model = 40, 128, 10, 4, "micro"
        args.durations = [0.0, 0.3]

    # Untimed burn-in, so one-time costs (lazy imports, kernel selection, caches) do not land on the baseline.
    run(0.0, True, argparse.Namespace(**{**vars(args), "max_steps": 3, "val_every": 3, "val_batches": 1}))
    runs = {("none", 0.0): run(0.0, True, args)}
    for mode in args.modes:
        for duration in sorted(d for d in args.durations if d > 0):
            runs[(mode, duration)] = run(duration, mode == "truncate", args)
    target = runs[("none", 0.0)][-1]["val_loss"]
    base_hit = time_to_target(runs[("none", 0.0)], target)
    print(
        f"\nSequence-length warmup, model={args.model}, max_length={args.max_length}, "
        f"micro_batch_size={args.micro_batch_size}, {args.max_steps} steps, "
        f"device={'cuda' if torch.cuda.is_available() else 'cpu'}, threads={args.threads}; "
        f"target = no-warmup final val loss {target:.4f}"
    )
    header = (
        f"{'mode':>8} | {'duration':>8} | {'final val':>9} | {'train s':>8} | {'tokens':>10} | "
        f"{'step@target':>11} | {'s@target':>8} | {'tokens@target':>13} | {'speed-up time':>13} | "
        f"{'speed-up tokens':>15}"
    )
    print(header)
    print("-" * len(header))
    table = []
    for (mode, duration), points in runs.items():
        hit = time_to_target(points, target)
        row = {
            "mode": mode,
            "duration": duration,
            "final_val_loss": points[-1]["val_loss"],
            "train_time": points[-1]["time"],
            "tokens": points[-1]["tokens"],
            "hit": hit,
            "speedup_time": base_hit["time"] / hit["time"] if hit else math.nan,
            "speedup_tokens": base_hit["tokens"] / hit["tokens"] if hit else math.nan,
        }
        table.append(row)
        at = (
            f"{hit['step']:>11} | {hit['time']:>8.1f} | {hit['tokens']:>13,}"
            if hit
            else f"{'not reached':>11} | {'-':>8} | {'-':>13}"
        )
        print(
            f"{mode:>8} | {duration:>8.2f} | {row['final_val_loss']:>9.4f} | {row['train_time']:>8.1f} | "
            f"{row['tokens']:>10,} | {at} | {row['speedup_time']:>12.2f}x | {row['speedup_tokens']:>14.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": vars(args), "rows": table, "points": {f"{m}:{d}": p for (m, d), p in runs.items()}},
                f,
                indent=2,
            )
    return {"rows": table, "points": runs}


if __name__ == "__main__":
    main()
