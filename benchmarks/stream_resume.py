"""Resuming a stream: the time to the first batch after a cut early in the stream and one late in it, side by side.

A resumed stream seeks: each reader goes back to its shard and, inside it, to the row it had reached (``datasets``
keeps the place per shard), with its packing window restored. So the time to the first resumed batch should not grow
with how far the run had gone. This script writes ``--docs`` short documents into ``--shards`` jsonl files, reads the
stream to each cut once (not timed) and saves the loader's state there, then, for each cut, starts a fresh process
that builds the DataModule and its train loader, loads the state and takes one batch: that process's time from its
first line to the batch, and the part after the loader is built (the median of ``--repeats`` processes per cut, run in
turn). For scale, the last column is the time one process takes to read the stream up to the cut (what resuming
without a position, by replaying, would cost).

    python benchmarks/stream_resume.py                      # 1,000,000 documents in 8 shards, cuts at 1 % and 90 %
    python benchmarks/stream_resume.py --docs 20000         # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

T0 = time.perf_counter()
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def write_shards(directory: str, docs: int, shards: int) -> list[str]:
    paths = [os.path.join(directory, f"part{s:03d}.jsonl") for s in range(shards)]
    files = [open(p, "w") for p in paths]
    for i in range(docs):  # shard s holds a contiguous block, as files of a real corpus do
        words = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(4 + i % 12))
        files[i * shards // docs].write(json.dumps({"text": f"{i} {words}"}) + "\n")
    for f in files:
        f.close()
    return paths


def datamodule(paths: list[str], workers: int):
    from lightning_seqmem import SeqMemDataModule

    return SeqMemDataModule(
        dataset=paths, streaming=True, max_length=256, micro_batch_size=8, strategy="pack", num_workers=workers
    )


def cut_state(paths: list[str], fraction: float, docs: int, workers: int, out: str) -> float:
    """Read the stream to ``fraction`` of its documents, save the loader's state to ``out``; the seconds it took."""
    import torch

    dm = datamodule(paths, workers)
    dm.setup("fit")
    loader = dm.train_dataloader()
    start = time.perf_counter()
    for _ in loader:
        if dm.stats()["train"]["documents"] >= fraction * docs:
            break
    seconds = time.perf_counter() - start
    torch.save(loader.state_dict(), out)
    return seconds


def resume(paths: list[str], state: str, workers: int) -> None:
    """Child: build, load, take one batch; print the seconds since start and since the loader existed."""
    import torch

    dm = datamodule(paths, workers)
    dm.setup("fit")
    loader = dm.train_dataloader()
    built = time.perf_counter()
    loader.load_state_dict(torch.load(state, weights_only=True))
    next(iter(loader))
    now = time.perf_counter()
    print(json.dumps({"total": now - T0, "after_build": now - built}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--cuts", type=float, nargs="+", default=[0.01, 0.9])
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per cut (the median is shown)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.child:
        resume(json.loads(args.child[0]), args.child[1], args.workers)
        return
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_shards(tmp, args.docs, args.shards)
        size = sum(os.path.getsize(p) for p in paths) / 1e6
        print(f"{args.docs:,} documents in {args.shards} jsonl shards ({size:.0f} MB), {args.workers} loader workers")
        states = {}
        for fraction in args.cuts:
            path = os.path.join(tmp, f"cut{fraction}.pt")
            states[fraction] = (path, cut_state(paths, fraction, args.docs, args.workers, path))
        timings: dict[float, list[dict]] = {fraction: [] for fraction in args.cuts}
        for _ in range(args.repeats):  # the cuts side by side, in turn, so the machine's load hits both alike
            for fraction in args.cuts:
                child = [sys.executable, __file__, "--workers", str(args.workers), "--child", json.dumps(paths)]
                out = subprocess.run([*child, states[fraction][0]], capture_output=True, text=True, check=True)
                timings[fraction].append(json.loads(out.stdout.strip().split("\n")[-1]))
        rows = []
        for fraction in args.cuts:
            total = statistics.median(t["total"] for t in timings[fraction])
            after = statistics.median(t["after_build"] for t in timings[fraction])
            rows.append((fraction, total, after, states[fraction][1]))
        print("| cut | to first resumed batch (fresh process) | of it after the loader is built | reading to the cut |")
        print("|---|---|---|---|")
        for fraction, total, after, replay in rows:
            print(f"| {fraction:.0%} | {total:.2f} s | {after:.3f} s | {replay:.1f} s |")
        first, last = rows[0], rows[-1]
        print(
            f"ratio, late cut / early cut: {last[1] / first[1]:.2f} (whole process), {last[2] / first[2]:.2f} (after build)"
        )


if __name__ == "__main__":
    main()
