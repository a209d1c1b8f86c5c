"""Mixing sources: what planning the mixed order costs, and how far each source strays from its share.

Three sources of packed rows (row sizes drawn per source: full rows, rows of 1-2 k tokens, short rows of 50-500
tokens, like a packed web set, a code set and a chat set) with weights 0.5 / 0.3 / 0.2, ``exhausted="repeat"``.
For each world size, every rank plans every rank's order (``MixedBatchSampler.rank_plans``, what each rank does at
the start of an epoch); the table gives the wall time of that plan, the microseconds per row, and the largest
deviation from the share over every batch boundary of rank 0, in rows of ``max_length`` (the bound is 1). Against it,
the same rows in a random order by weight of rows, per step (what mixing by sample draws gives).

    python benchmarks/mixing.py                  # 1 M rows
    python benchmarks/mixing.py --rows 100000    # smoke test
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from lightning_seqmem.mixing.sampler import MixedBatchSampler

MAX_LENGTH = 2048
WEIGHTS = (0.5, 0.3, 0.2)


def _sources(rows: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    counts = [rows // 2, rows * 3 // 10, rows - rows // 2 - rows * 3 // 10]
    return [
        np.full(counts[0], MAX_LENGTH),
        rng.integers(1000, 2049, size=counts[1]),
        rng.integers(50, 501, size=counts[2]),
    ]


def _worst(rows: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, bounds: np.ndarray) -> float:
    """The largest ``|w_s T - t_s|`` over batch boundaries, in rows of ``MAX_LENGTH``."""
    source = np.searchsorted(offsets, rows, side="right") - 1
    served = np.zeros((len(rows), len(WEIGHTS)))
    served[np.arange(len(rows)), source] = sizes[rows]
    served = np.cumsum(served, axis=0)[bounds[1:] - 1]
    gap = np.asarray(WEIGHTS) * served.sum(1, keepdims=True) - served
    return float(np.abs(gap).max() / MAX_LENGTH)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    args = parser.parse_args()
    sources = _sources(args.rows)
    sizes = np.concatenate(sources)
    print(f"{args.rows:,} packed rows, weights {WEIGHTS}, max_length {MAX_LENGTH}, 8 rows per batch\n")
    print(
        "| ranks | plan (s, every rank's order) | µs per row | worst share gap, rows (bound 1) | random draw by row weight |"
    )
    print("|---:|---:|---:|---:|---:|")
    for world in (1, 8):
        sampler = MixedBatchSampler(WEIGHTS, sources, sources, "repeat", 8, seed=0, num_replicas=world, rank=0)
        start = time.perf_counter()
        plans = sampler.rank_plans(0)
        seconds = time.perf_counter() - start
        planned = sum(len(rows) for rows, _ in plans)
        rows, bounds = plans[0]
        gap = _worst(rows, sampler.offsets, sizes, bounds)
        rng = np.random.default_rng(1)  # by weight of rows, per draw: what random mixing by sample gives
        draws = rng.choice(len(WEIGHTS), size=len(rows), p=WEIGHTS)
        random_rows = np.asarray([rng.integers(sampler.offsets[s], sampler.offsets[s + 1]) for s in draws])
        random_gap = _worst(random_rows, sampler.offsets, sizes, bounds)
        print(f"| {world} | {seconds:.1f} | {seconds / planned * 1e6:.1f} | {gap:.2f} | {random_gap:.1f} |")


if __name__ == "__main__":
    main()
