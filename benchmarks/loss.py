"""Loss-layer benchmark: the LM head and its cross-entropy alone, full logits vs chunked (vs Liger-Kernel on CUDA).

One step of the loss layer: hidden states ``[tokens, hidden]`` and the head's weight ``[vocab, hidden]`` in, the loss
and the gradients of both out. Methods:

- ``full``: ``F.cross_entropy((hidden @ weight.T).float(), labels)``, what transformers' loss does on the logits;
- ``chunked``: :func:`lightning_seqmem.training.linear_cross_entropy.linear_cross_entropy` (``--chunk-sizes``);
- ``liger``: Liger-Kernel's fused linear cross-entropy, on CUDA where ``liger_kernel`` is installed.

Each measurement runs in a fresh subprocess: peak live tensor bytes above the inputs (``torch.profiler``'s
allocation events on CPU, ``max_memory_allocated`` on CUDA) and wall time, the median of up to ``--repeats`` runs
(fewer where one run takes longer than ``--budget`` seconds; every CPU run is profiled, which costs microseconds per
op against seconds of matmuls). On CPU the tensors are fp32; on CUDA bf16 (``--dtype``). ``ignored`` is the share of
labels set to -100 (at random positions); the full path computes every position's logits whatever the labels.

    python benchmarks/loss.py                        # the default grid for this device (docs/loss.md)
    python benchmarks/loss.py --grid all             # hidden 896/4096 x vocab 32,000/128,256/151,936 x 2,048/8,192
    python benchmarks/loss.py --smoke                # tiny sizes, seconds
    python benchmarks/loss.py --cells 896x128256x2048 --methods chunked --chunk-sizes 128,512,2048   # tune
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time

from lightning_seqmem.memory.stats import format_bytes

ALL_CELLS = [  # (hidden, vocab, tokens, ignored share)
    (hidden, vocab, tokens, 0.0)
    for hidden, vocab, tokens in itertools.product((896, 4096), (32000, 128256, 151936), (2048, 8192))
] + [(896, 128256, 8192, 0.3), (4096, 128256, 8192, 0.3)]

# 2 shared CPU cores: the matmuls scale with hidden x vocab x tokens, so hidden 4,096 runs at the smallest vocabulary
# only, and 8,192 tokens at the vocabulary the targets name; the full path at 30 % ignored labels does what it does
# at none (it computes every position's logits), measured at the small cell to show it.
CPU_CELLS = [
    (896, 32000, 2048, 0.0),
    (896, 32000, 2048, 0.3),
    (896, 128256, 2048, 0.0),
    (896, 151936, 2048, 0.0),
    (4096, 32000, 2048, 0.0),
    (896, 128256, 8192, 0.0),
    (896, 128256, 8192, 0.3),
]
CPU_SKIP_FULL = {(896, 128256, 8192, 0.3)}  # same work as the row above it

SMOKE_CELLS = [(64, 1000, 256, 0.0), (64, 1000, 256, 0.3)]


def _worker(spec: dict) -> dict:
    """Build the inputs, run the method ``repeats`` times (within ``budget`` seconds); peak bytes and times."""
    import torch
    import torch.nn.functional as F

    from lightning_seqmem.memory.measured import profiled_allocations
    from lightning_seqmem.training.liger_cross_entropy import liger_linear_cross_entropy
    from lightning_seqmem.training.linear_cross_entropy import linear_cross_entropy

    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(spec["tokens"], spec["hidden"], generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(spec["vocab"], spec["hidden"], generator=g) * 0.02).to(device, dtype).requires_grad_()
    labels = torch.randint(0, spec["vocab"], (spec["tokens"],), generator=g)
    labels[torch.randperm(spec["tokens"], generator=g)[: round(spec["ignored"] * spec["tokens"])]] = -100
    labels = labels.to(device)

    def loss():
        if spec["method"] == "full":
            return F.cross_entropy((hidden @ weight.T).float(), labels)
        if spec["method"] == "liger":
            return liger_linear_cross_entropy(hidden, weight, labels)
        return linear_cross_entropy(hidden, weight, labels, chunk_size=spec["chunk_size"])

    def step():
        hidden.grad = weight.grad = None
        loss().backward()

    cuda = device.type == "cuda"
    if cuda:
        step()  # warm-up: kernels compiled, cuBLAS workspaces allocated
    else:  # warm-up on a few tokens: first-call costs (the import of torch.compiler.disable's machinery) left out
        with torch.enable_grad():
            small = hidden[:8].detach().requires_grad_(), weight[:64].detach().requires_grad_()
            F.cross_entropy(small[0] @ small[1].T, labels[:8].clamp(0, 63)).backward()
            linear_cross_entropy(*small, labels[:8].clamp(0, 63), chunk_size=4).backward()
    times, peak, start = [], 0, time.perf_counter()
    while not times or (len(times) < spec["repeats"] and time.perf_counter() - start < spec["budget"]):
        hidden.grad = weight.grad = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            peak = torch.cuda.max_memory_allocated() - base
        else:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            live = peak = 0
            for _, size in profiled_allocations(prof):
                live += size
                peak = max(peak, live)
    return {"peak": peak, "times": times}


def measure(spec: dict) -> dict:
    """:func:`_worker` in a fresh interpreter (a clean allocator, and the full path's memory returned at exit)."""
    cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script in seconds")
    parser.add_argument("--grid", choices=("default", "all"), default="default", help="default: this device's grid")
    parser.add_argument("--cells", help="comma-separated HIDDENxVOCABxTOKENS[xIGNORED], instead of a grid")
    parser.add_argument("--methods", default="full,chunked,liger", help="comma-separated; liger only where it runs")
    parser.add_argument("--chunk-sizes", default=None, help="comma-separated chunk sizes for the chunked method")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument("--budget", type=float, default=30.0, help="no further repeat after this many seconds")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda where available)")
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: float32 on CPU, bf16 on CUDA)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return

    import torch

    from lightning_seqmem.training.linear_cross_entropy import DEFAULT_CHUNK_SIZE

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    if args.cells:
        cells = [
            tuple(float(x) if i == 3 else int(x) for i, x in enumerate(c.split("x"))) for c in args.cells.split(",")
        ]
        cells = [c if len(c) == 4 else (*c, 0.0) for c in cells]
    elif args.smoke:
        cells = SMOKE_CELLS
    else:
        cells = ALL_CELLS if args.grid == "all" or device == "cuda" else CPU_CELLS
    chunk_sizes = [int(c) for c in args.chunk_sizes.split(",")] if args.chunk_sizes else [DEFAULT_CHUNK_SIZE]
    if args.smoke:
        chunk_sizes, args.repeats = [100], 1
    methods = args.methods.split(",")
    try:
        import liger_kernel  # noqa: F401

        has_liger = device == "cuda"
    except ImportError:
        has_liger = False
    if "liger" in methods and not has_liger:
        methods.remove("liger")
        print("liger: left out (needs `pip install liger-kernel` and a CUDA device)")

    runs = []  # (cell, method, chunk size)
    for cell in cells:
        for method in methods:
            if method == "full" and device == "cpu" and cell in CPU_SKIP_FULL and not args.cells:
                continue
            runs += [(cell, method, c) for c in (chunk_sizes if method == "chunked" else [None])]
    print(f"torch {torch.__version__}, {device}, {dtype}, {len(runs)} measurements", flush=True)
    header = "| hidden | vocab | tokens | ignored | method | chunk | peak above inputs | vs full | time (s) | vs full | runs |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    full_results: dict[tuple, dict] = {}
    for (hidden, vocab, tokens, ignored), method, chunk in runs:
        spec = dict(hidden=hidden, vocab=vocab, tokens=tokens, ignored=ignored, method=method, chunk_size=chunk,
                    repeats=args.repeats, budget=args.budget, device=device, dtype=dtype)  # fmt: skip
        result = measure(spec)
        if method == "full" and "error" not in result:
            full_results[hidden, vocab, tokens, ignored] = result
        if "error" in result:
            cols = ["error: " + result["error"][:80], "", "", "", ""]
        else:
            median = statistics.median(result["times"])
            # the full path at the same labels, else at none ignored (the same work: it computes every logit)
            same = full_results.get((hidden, vocab, tokens, ignored)) or full_results.get((hidden, vocab, tokens, 0.0))
            base = same if method != "full" else None
            mem_ratio = f"1/{base['peak'] / result['peak']:.1f}" if base and result["peak"] else ""
            time_ratio = f"{median / statistics.median(base['times']):.2f}x" if base else ""
            cols = [format_bytes(result["peak"]), mem_ratio, f"{median:.2f}", time_ratio, str(len(result["times"]))]
        row = [hidden, vocab, tokens, f"{ignored:.0%}", method, chunk or "", *cols]
        print("| " + " | ".join(str(c) for c in row) + " |", flush=True)


if __name__ == "__main__":
    main()
