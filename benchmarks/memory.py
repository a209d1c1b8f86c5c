"""Memory benchmark: warmup-style training (sequence length grows every few steps) with and without cache
pre-allocation and expandable segments.

Each configuration runs in a fresh subprocess, because the CUDA caching allocator reads ``PYTORCH_ALLOC_CONF`` once.
On CUDA it prints, per configuration: reserved memory after step 1 vs peak, reserved growth after step 1,
``num_alloc_retries``, device allocations (cudaMalloc calls) and fragmentation at peak (the share of peak reserved
memory stranded in inactive split blocks, as ``MemoryMonitor`` reports it). Without a GPU it runs on CPU and prints
RSS figures instead (the allocator settings do nothing there); CUDA figures need a GPU.

    python benchmarks/memory.py                       # all four configurations, default sizes
    python benchmarks/memory.py --lengths 256,512,1024,2048 --rows 8 --hidden 512 --layers 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from lightning_seqmem.memory.stats import format_bytes as fmt  # no torch import: the worker sets the env var first

CONFIGS = [  # (name, pre-allocation, expandable segments)
    ("baseline", False, False),
    ("expandable", False, True),
    ("prealloc", True, False),
    ("prealloc+expandable", True, True),
]


def _worker(args: argparse.Namespace) -> dict:
    from lightning_seqmem.memory.allocator import ENV_VAR, LEGACY_ENV_VAR, configure_allocator

    for name in (ENV_VAR, LEGACY_ENV_VAR):
        os.environ.pop(name, None)  # each configuration decides for itself
    if args.expandable:
        configure_allocator()
    else:
        os.environ[ENV_VAR] = os.environ[LEGACY_ENV_VAR] = "expandable_segments:False"

    import lightning.pytorch as L
    import torch
    from torch.utils.data import DataLoader
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_seqmem.memory import CachePreallocator, stats

    cuda = torch.cuda.is_available() and args.device != "cpu"
    lengths = [int(n) for n in args.lengths.split(",")]
    schedule = [lengths[min(step // args.every, len(lengths) - 1)] for step in range(args.steps)]

    class WarmupData(L.LightningDataModule):
        """Batches whose length grows every ``every`` steps (what sequence-length warmup produces)."""

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            batches = []
            for length in schedule:
                ids = torch.randint(0, args.vocab, (args.rows, length), generator=g)
                batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
            return DataLoader(batches, batch_size=None)

        def batch_keys(self):
            return ("input_ids", "attention_mask", "labels")

        def max_batch_shape(self):
            return args.rows, max(lengths)

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            config = LlamaConfig(
                vocab_size=args.vocab,
                hidden_size=args.hidden,
                intermediate_size=4 * args.hidden,
                num_hidden_layers=args.layers,
                num_attention_heads=max(1, args.hidden // 64),
                max_position_embeddings=max(lengths),
            )
            self.model = LlamaForCausalLM(config)

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch, use_cache=False).loss
            self.log("loss", loss, batch_size=args.rows)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Recorder(L.Callback):
        def __init__(self):
            self.after_step1: dict = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 1 and not self.after_step1:
                if cuda:
                    torch.cuda.synchronize()
                    self.after_step1 = dict(torch.cuda.memory_stats())
                else:
                    self.after_step1 = {"rss": stats.peak_rss_bytes()}

    recorder = Recorder()
    callbacks = [CachePreallocator(), recorder] if args.prealloc else [recorder]
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        precision="bf16-mixed" if cuda and torch.cuda.is_bf16_supported() else "32-true",
        callbacks=callbacks,
    )
    trainer.fit(LM(), datamodule=WarmupData())
    if cuda:
        end = torch.cuda.memory_stats()
        first = recorder.after_step1
        peak_reserved = end["reserved_bytes.all.peak"]
        return {
            "device": torch.cuda.get_device_name(),
            "reserved_after_step1": first["reserved_bytes.all.current"],
            "peak_reserved": peak_reserved,
            "growth_after_step1": peak_reserved - first["reserved_bytes.all.current"],
            "num_alloc_retries": end["num_alloc_retries"],
            "retries_after_step1": end["num_alloc_retries"] - first["num_alloc_retries"],
            "device_allocs": end.get("num_device_alloc"),
            "fragmentation_at_peak": stats.stranded_share(end["inactive_split_bytes.all.peak"], peak_reserved),
        }
    peak = stats.peak_rss_bytes()
    return {
        "device": "cpu",
        "rss_after_step1": recorder.after_step1["rss"],
        "peak_rss": peak,
        "growth_after_step1": peak - recorder.after_step1["rss"],
    }


def _table(results: dict[str, dict]) -> str:
    first = next(iter(results.values()))
    if first["device"] == "cpu":
        header = f"{'config':<22}{'RSS after step 1':>18}{'peak RSS':>12}{'growth after step 1':>21}"
        rows = [
            f"{name:<22}{fmt(r['rss_after_step1']):>18}{fmt(r['peak_rss']):>12}{fmt(r['growth_after_step1']):>21}"
            for name, r in results.items()
        ]
    else:
        header = (
            f"{'config':<22}{'reserved@1':>12}{'peak reserved':>15}{'growth':>12}{'retries':>9}"
            f"{'device allocs':>15}{'frag@peak':>11}"
        )
        rows = [
            f"{name:<22}{fmt(r['reserved_after_step1']):>12}{fmt(r['peak_reserved']):>15}"
            f"{fmt(r['growth_after_step1']):>12}{r['num_alloc_retries']:>9}{str(r['device_allocs']):>15}"
            f"{r['fragmentation_at_peak']:>10.1%}"
            for name, r in results.items()
        ]
    return "\n".join([header, *rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="64,128,256,512", help="sequence lengths of the warmup, in order")
    parser.add_argument("--every", type=int, default=3, help="steps per warmup length")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--device", choices=("auto", "cpu"), default="auto")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prealloc", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--expandable", action="store_true", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(_worker(args)))
        return

    passthrough = list(argv if argv is not None else sys.argv[1:])
    results = {}
    for name, prealloc, expandable in CONFIGS:
        cmd = [sys.executable, os.path.abspath(__file__), *passthrough, "--worker"]
        cmd += ["--prealloc"] * prealloc + ["--expandable"] * expandable
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[name] = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    print(
        f"lengths {args.lengths} (every {args.every} steps), rows {args.rows}, hidden {args.hidden}, "
        f"layers {args.layers}, {args.steps} steps; device: {next(iter(results.values()))['device']}"
    )
    print(_table(results))
    if next(iter(results.values()))["device"] == "cpu":
        print(
            "No GPU: these are CPU figures (process RSS; allocator settings have no effect on CPU). "
            "The CUDA figures (reserved after step 1 vs peak, num_alloc_retries, device allocations, "
            "fragmentation at peak) need a GPU: run this script on one."
        )


if __name__ == "__main__":
    main()
