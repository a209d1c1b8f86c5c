"""Packing benchmark: lightning_seqmem's ``pack_sequences``/``pack_lengths`` side by side with TRL's ``pack_dataset``.

For each dataset and strategy: token efficiency (real tokens / (rows x max_length)), tokens lost, documents split,
time and documents/s. Datasets: the two published length histograms (Wikipedia @512, SQuAD 1.1 @384), a synthetic
10-million-document heavy-tailed set, and the built-in corpus.

TRL runs on the same documents (token lists of the same lengths) in the same process. Where TRL would take
minutes, both run on the same random subsample for the side-by-side rows, and ours also runs on the full set
(lengths only: 10 M documents of real tokens would not fit in memory). TRL's ``pack_dataset`` packs inside
``datasets.map`` batches (1,000 documents by default), so its BFD is per batch; ours is over the whole set.

    python benchmarks/packing.py            # full run
    python benchmarks/packing.py --quick    # smaller subsamples, no 10 M set
    python benchmarks/packing.py --floor    # packed rows against one plain copy of the token column, and TRL

``--floor`` (``packing_floor.py``): a ``datasets.Dataset`` in, packed token rows out (the Dataset TRL's
``pack_dataset`` returns), timed side by side in one process against one plain copy of the token column and
TRL's ``bfd_split``, for each fast input form, with where the time goes.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from lightning_seqmem.batching import pack_lengths, pack_sequences

HISTOGRAMS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "length-histograms"


def load_histogram(path: Path) -> np.ndarray:
    """``length<TAB>count`` rows (with a header) to one length per sequence."""
    table = np.loadtxt(path, dtype=np.int64, delimiter="\t", skiprows=1, ndmin=2)
    return np.repeat(table[:, 0], table[:, 1])


def synthetic_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Heavy-tailed lengths: log-normal body (median ~150 tokens) with a Pareto tail to 32k tokens."""
    rng = np.random.default_rng(seed)
    body = rng.lognormal(5.0, 1.0, n)
    tail = rng.random(n) < 0.02
    body[tail] = 1000 * (1 + rng.pareto(1.2, int(tail.sum())))
    return np.clip(body.astype(np.int64), 1, 32768)


def fake_tokens(lengths: np.ndarray, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random token ids for documents of these lengths, as ``(flat, offsets)``."""
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return np.random.default_rng(seed).integers(1, 32000, int(offsets[-1]), dtype=np.int32), offsets


def crossings(lengths: np.ndarray, max_length: int) -> int:
    """Documents that ``wrapped`` packing cuts across a row boundary."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    return int(((ends - 1) // max_length > starts // max_length).sum())


def row(dataset, n_docs, method, efficiency, lost, split, seconds, materialise=None):
    return dict(
        dataset=dataset,
        docs=n_docs,
        method=method,
        efficiency=efficiency,
        lost=lost,
        split=split,
        seconds=seconds,
        docs_per_s=n_docs / max(seconds, 1e-9),
        materialise=materialise,
    )


def timed(fn):
    """Best of several runs (5 for runs under a second, else 2): the first also pays for page faults."""
    best, result, runs = float("inf"), None, 0
    while runs < (5 if best < 1.0 else 2):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
        runs += 1
    return best, result


def ours(name: str, lengths: np.ndarray, max_length: int, tokens=None) -> list[dict]:
    out = []
    for label, packing, overflow in [
        ("ours bfd (split)", "bfd", "split"),
        ("ours bfd (truncate)", "bfd", "truncate"),
        ("ours wrapped", "wrapped", "split"),
    ]:
        seconds, res = timed(
            lambda: (
                pack_sequences(tokens, max_length, packing, overflow)
                if tokens is not None
                else pack_lengths(lengths, max_length, packing, overflow)
            )
        )
        materialise = None
        if tokens is not None:  # rows are gathered lazily when served; this is the cost of gathering all of them
            materialise, _ = timed(
                lambda: res._segments(0, len(res.segment_length)) if packing == "bfd" else res.input_ids
            )
        out.append(
            row(
                name,
                len(lengths),
                label + ("" if tokens is not None else " [lengths]"),
                res.efficiency,
                res.tokens_truncated + res.tokens_dropped,
                res.documents_split,
                seconds,
                materialise,
            )
        )
    return out


def trl(name: str, lengths: np.ndarray, max_length: int, tokens) -> list[dict]:
    import datasets
    import pyarrow as pa
    from trl.data_utils import pack_dataset

    flat, offsets = tokens
    table = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat))})
    ds = datasets.Dataset(datasets.table.InMemoryTable(table))
    total = int(lengths.sum())
    out = []
    for strategy in ("bfd", "bfd_split", "wrapped"):
        seconds, packed = timed(lambda: pack_dataset(ds, max_length, strategy=strategy))
        packed_lengths = np.asarray(pa.compute.list_value_length(packed.data.column("input_ids")).to_numpy())
        kept = int(packed_lengths.sum())
        split = {"bfd": 0, "bfd_split": int((lengths > max_length).sum()), "wrapped": crossings(lengths, max_length)}
        out.append(
            row(
                name,
                len(lengths),
                f"trl {strategy}",
                kept / (len(packed) * max_length),
                total - kept,
                split[strategy],
                seconds,
            )
        )
    return out


def side_by_side(name: str, lengths: np.ndarray, max_length: int, sample: int, seed: int = 0) -> list[dict]:
    """Ours on the full set (lengths) and, on the same subsample with real tokens, ours and TRL."""
    rows = ours(name, lengths, max_length)
    # Shuffled: a histogram comes sorted by length, which would cripple TRL's per-map-batch packing.
    sub = np.random.default_rng(seed).permutation(lengths)[:sample]
    label = f"{name} (sample {sample:,})" if len(lengths) > sample else name
    tokens = fake_tokens(sub, seed)
    return rows + ours(label, sub, max_length, tokens) + trl(label, sub, max_length, tokens)


def builtin_corpus(max_length: int) -> list[dict]:
    try:
        from lightning_seqmem.data.corpus import load_builtin_corpus
        from lightning_seqmem.data.tokenizer import load_tokenizer
    except ImportError:
        print("(built-in corpus not available: skipped)")
        return []
    tok = load_tokenizer()
    texts = load_builtin_corpus(verbose=False)["train"]["text"]
    ids = [x + [tok.eos_token_id] for x in tok(list(texts), add_special_tokens=False)["input_ids"]]
    ids = [x for x in ids if len(x) > 1]
    lengths = np.array([len(x) for x in ids])
    flat = np.concatenate([np.asarray(x, dtype=np.int32) for x in ids])
    tokens = (flat, np.concatenate([[0], np.cumsum(lengths)]))
    name = f"builtin corpus @{max_length}"
    return ours(name, lengths, max_length, tokens) + trl(name, lengths, max_length, tokens)


def print_table(rows: list[dict]) -> None:
    print(
        "| dataset | docs | method | efficiency | tokens lost | docs split | time (s) | docs/s | + gather all rows (s) |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        gather = "" if r["materialise"] is None else f"{r['materialise']:.3f}"
        print(
            f"| {r['dataset']} | {r['docs']:,} | {r['method']} | {r['efficiency']:.5f} | {r['lost']:,} | "
            f"{r['split']:,} | {r['seconds']:.3f} | {r['docs_per_s']:,.0f} | {gather} |"
        )


def speedups(rows: list[dict]) -> None:
    """Ours vs TRL on identical input: bfd(split) vs trl bfd_split, bfd(truncate) vs trl bfd, wrapped vs wrapped."""
    pairs = {"ours bfd (split)": "trl bfd_split", "ours bfd (truncate)": "trl bfd", "ours wrapped": "trl wrapped"}
    print("\n| dataset | ours vs TRL | speed-up | speed-up incl. gathering every row |\n|---|---|---:|---:|")
    for r in rows:
        match = [t for t in rows if t["dataset"] == r["dataset"] and t["method"] == pairs.get(r["method"])]
        if match:
            trl_s = match[0]["seconds"]
            print(
                f"| {r['dataset']} | {r['method']} vs {match[0]['method']} | {trl_s / max(r['seconds'], 1e-9):,.1f}x | "
                f"{trl_s / max(r['seconds'] + (r['materialise'] or 0), 1e-9):,.1f}x |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small subsamples, no 10 M synthetic set")
    parser.add_argument("--sample", type=int, default=None, help="documents given to TRL (default 200k, quick 20k)")
    parser.add_argument("--floor", action="store_true", help="packed rows vs one copy of the token column, and TRL")
    parser.add_argument("--documents", type=int, default=17_846, help="--floor: documents per corpus")
    parser.add_argument("--repeats", type=int, default=9, help="--floor: timed runs per figure (best kept)")
    args = parser.parse_args()
    if args.floor:
        from packing_floor import main as floor_main

        floor_main(args.documents, args.repeats)
        return
    sample = args.sample or (20_000 if args.quick else 200_000)
    rows: list[dict] = []
    for file, max_length, name in [
        ("wikipedia-512.tsv", 512, "Wikipedia @512"),
        ("squad-1.1-384.tsv", 384, "SQuAD 1.1 @384"),
    ]:
        path = HISTOGRAMS / file
        if not path.exists():
            print(f"({path} not found: skipped)")
            continue
        rows += side_by_side(name, load_histogram(path), max_length, sample)
    n_synth = 1_000_000 if args.quick else 10_000_000
    rows += side_by_side(f"synthetic {n_synth / 1e6:g} M @2048", synthetic_lengths(n_synth), 2048, sample)
    rows += builtin_corpus(512)
    print_table(rows)
    speedups(rows)


if __name__ == "__main__":
    main()
