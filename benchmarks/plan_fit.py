"""seqmem-plan's fit search on model shapes too big to build: what fits a device budget, and how long the search took.

    python benchmarks/plan_fit.py                       # Llama-3-8B and Qwen2.5-0.5B shapes, 4,096 and 8,192 tokens,
                                                        # 24 GiB and 80 GiB, the run as seqmem-plan's defaults plan it
    python benchmarks/plan_fit.py --shapes llama3_8b --lengths 4096 --budgets 24GiB --devices 4

The run searched from: bf16-mixed, no checkpointing, ``cross_entropy="auto"``, ``micro_batch_size=8`` (the
built-in data config's), padded rows (an attention mask), one device unless ``--devices``. Each line is
``format_fit`` of the answer, whose peak is the estimate of exactly that configuration (``memory.layer_scaling``).
"""

from __future__ import annotations

import argparse
import time

SHAPES = {
    "llama3_8b": dict(
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
    ),
    "qwen2.5_0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096, 8192])
    parser.add_argument("--budgets", nargs="+", default=["24GiB", "80GiB"])
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    start = time.perf_counter()
    from lightning_seqmem.apps.plan_memory import parse_bytes
    from lightning_seqmem.apps.plan_report import format_fit
    from lightning_seqmem.apps.plan_search import RunSettings, search_fit
    from lightning_seqmem.training.building import build_model_config

    print(f"imports: {time.perf_counter() - start:.1f} s")
    for name in args.shapes:
        config = build_model_config(dict(SHAPES[name]), SHAPES[name]["vocab_size"], None)
        for length in args.lengths:
            for budget in args.budgets:
                run = RunSettings(
                    config, length, precision=args.precision, micro_batch_size=args.micro_batch_size,
                    devices=args.devices,
                )  # fmt: skip
                began = time.perf_counter()
                try:
                    line = format_fit(search_fit(run, parse_bytes(budget)))
                except ValueError as error:
                    line = f"{name}, {length:,} tokens, {budget}: {error}"
                print(f"{name}: {line} [{time.perf_counter() - began:.1f} s with this process's caches]", flush=True)
    print(f"total: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
