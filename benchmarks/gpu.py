"""The memory half of the bundle on a real GPU, in one command and one table (issue 17).

    python benchmarks/gpu.py            # CUDA: the sizes below, under 10 minutes on one H100
    python benchmarks/gpu.py --smoke    # tiny sizes; runs on CPU too (checks the script, not the targets)
    python benchmarks/gpu.py --sections paths   # only the GPU paths of issue 45 (benchmarks/gpu_paths.py)

The table and each section's log are written under ``$OUT`` when it is set (``gpu_table.md``, ``gpu_log.txt``).

On the lent CUDA machine: ``source .gpu-wheels/on-gpu.sh && python3 benchmarks/gpu.py`` (../shared/gpu/README.md).

Rows of the table, each with its target:

- pre-allocation: a ~125 M-parameter Llama (hidden 768, 12 layers, vocabulary 32,000), bf16-mixed,
  ``SeqLengthWarmup`` 64 -> 4,096 tokens over the first half of 60 steps, micro-batch 8, pre-tokenized documents
  of log-normal lengths; pad and pack, with and without expandable segments (each run in a fresh process: the
  allocator reads its settings once), plus pad without anything and pad with no row ever padded. Reserved memory
  after step 1, peak reserved, growth after step 1 and ``num_alloc_retries``; target with ``CachePreallocator``:
  growth <= 1 % of peak reserved, 0 retries.
- planner: the traced estimate (``estimate_training_memory``) vs ``torch.cuda.max_memory_allocated()`` of the same
  two training steps, nine Llama sizes from 8.7 M to 357 M parameters; target: every case within 5 %.
- contamination: per-document losses of packed rows vs each document alone, sdpa and eager, fp32 and bf16; the
  same rows without ``position_ids`` (documents attending to each other) show what contamination would look like.
- FSDP: ``FSDPStrategy`` with ``gradient_clip_val=1.0`` and ``CachePreallocator``: trains, the pass ran.
- monitor: ``MemoryMonitor``'s end-of-run summary (60 steps, logging every 7: the last step is not a logging step).
- paths (:mod:`gpu_paths`): the ``torch_varlen`` step under bf16-mixed, a real CUDA OOM in the backward under
  ``on_oom="split"``, FSDP bf16-mixed rotary buffers, a QLoRA step with checkpointing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import gpu_paths
from gpu_memory import MEMORY_CHILDREN, PREALLOC_RUNS, sizes

from lightning_seqmem.memory.stats import format_bytes  # imports no torch: children set the allocator first

SECTIONS = ("prealloc", "planner", "contamination", "fsdp", "paths")
LOG: list[str] = []  # every child's stderr tail, for $OUT

CHILDREN = {**MEMORY_CHILDREN, **gpu_paths.CHILDREN}


def run_child(smoke: bool, kind: str, *args) -> object:
    """Run one section in a fresh process (its own allocator settings and statistics); its JSON result."""
    command = [sys.executable, __file__, "--child", kind, json.dumps(args)] + (["--smoke"] if smoke else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    LOG.append(f"=== {kind} {args} (exit {done.returncode})\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1][len("RESULT ") :])


# ----------------------------------------------------------------------------------------------- the table
def rows(smoke: bool, sections: tuple[str, ...] = SECTIONS) -> list[tuple[str, str, str, str, bool]]:
    """(check, case, measured, target, ok) for every row of the table."""
    out = []
    for run in PREALLOC_RUNS if "prealloc" in sections else ():
        r = run_child(smoke, "prealloc", *run)
        if "error" in r:
            out.append(("pre-allocation", run[0], r["error"], "runs", False))
            continue
        share = r["growth"] / r["peak"] if r["peak"] else 0.0
        text = (
            f"after step 1 {format_bytes(r['after_step_1'])}, peak {format_bytes(r['peak'])}, growth "
            f"{format_bytes(r['growth'])} ({share:.1%}), retries {r['retries']}, {r['seconds']:.0f} s"
        )
        target, ok = "reference", True
        if run[2]:
            target, ok = "growth <= 1 % of peak, 0 retries", share <= 0.01 and r["retries"] == 0
        out.append(("pre-allocation", run[0], text, target, ok))
        if run[0] == "pad, CachePreallocator + expandable":
            summary = ", ".join(f"{k}={v:.3g}" for k, v in r["monitor"].items())
            out.append(
                (
                    "monitor",
                    "end-of-run summary, last step not a logging step",
                    summary,
                    "summary, no crash",
                    "steps" in r["monitor"],
                )
            )
    planner = run_child(smoke, "planner") if "planner" in sections else []
    if isinstance(planner, dict):
        out.append(("planner", "all sizes", planner["error"], "runs", False))
    else:
        for case in planner:
            error = (case["estimate"] - case["measured"]) / case["measured"]
            out.append(
                (
                    "planner",
                    f"{case['params'] / 1e6:.1f} M parameters",
                    f"estimate {format_bytes(case['estimate'])}, measured {format_bytes(case['measured'])}, "
                    f"error {error:+.2%}",
                    "within 5 %",
                    abs(error) <= 0.05,
                )
            )
    contamination = run_child(smoke, "contamination") if "contamination" in sections else []
    if isinstance(contamination, dict):
        out.append(("contamination", "all", contamination["error"], "runs", False))
    else:
        for case in contamination:
            tolerance = 1e-4 if case["dtype"] == "float32" else 5e-2
            out.append(
                (
                    "contamination",
                    f"{case['attn']}, {case['dtype']}",
                    f"largest loss difference packed vs alone {case['clean']:.2e} (documents mixed: "
                    f"{case['contaminated']:.2e})",
                    f"<= {tolerance:g}",
                    case["clean"] <= tolerance < case["contaminated"],
                )
            )
    f = run_child(smoke, "fsdp") if "fsdp" in sections else None
    if f is None:
        pass
    elif "error" in f:
        out.append(("FSDP", "clipping + pre-allocation", f["error"], "runs", False))
    else:
        share = f["growth"] / f["peak"] if f["peak"] else 0.0
        out.append(
            (
                "FSDP",
                "gradient_clip_val=1.0 + CachePreallocator, 10 steps",
                f"steps {f['steps']}, loss {f['loss']:.3f}, passes {'+'.join(f['passes'])}, growth {share:.1%}, "
                f"retries {f['retries']}",
                "trains, pass ran",
                f["steps"] == 10 and math.isfinite(f["loss"]) and bool(f["passes"]),
            )
        )
    if "paths" in sections:
        out.extend(gpu_paths.rows(smoke, run_child))
    return out


def software() -> str:
    """The device and the versions that matter, first (the lent machine's software is not known in advance)."""
    import platform

    import lightning
    import torch
    import transformers

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (no CUDA: figures are not GPU's)"
    return (
        f"{device}; Python {platform.python_version()}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
        f"transformers {transformers.__version__}; lightning {lightning.__version__}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (runs on CPU): checks the script only")
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)} (default: all)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("args", nargs="?", default="[]", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        size = (gpu_paths.sizes if args.child in gpu_paths.CHILDREN else sizes)(args.smoke)
        print("RESULT " + json.dumps(CHILDREN[args.child](size, *json.loads(args.args))), flush=True)
        return
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {unknown}: choose from {', '.join(SECTIONS)}")
    start = time.perf_counter()
    versions = software()
    print(versions, flush=True)
    table = rows(args.smoke, sections)
    text = (
        f"\n{versions}; {'smoke sizes' if args.smoke else 'full sizes'}; sections {','.join(sections)}; "
        f"{time.perf_counter() - start:.0f} s\n\n| check | case | measured | target | ok |\n|---|---|---|---|---|\n"
        + "".join(f"| {c} | {case} | {m} | {t} | {'yes' if ok else 'NO'} |\n" for c, case, m, t, ok in table)
    )
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_table.md"), "w") as out:
            out.write(text)
        with open(os.path.join(os.environ["OUT"], "gpu_log.txt"), "w") as out:
            out.write("\n".join(LOG))
    # smoke sizes check that every section runs (their figures are not the GPU's); full sizes check the targets
    strict = ("FSDP", *gpu_paths.CHECKS)  # sections whose smoke run checks its figures too
    failed = [row for row in table if not row[-1] and (not args.smoke or row[3] == "runs" or row[0] in strict)]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
