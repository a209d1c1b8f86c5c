"""Packing at the copy floor: ``datasets.Dataset`` in, packed token rows out, against one plain copy of the tokens.

Run through ``python benchmarks/packing.py --floor``. Two corpora of 17,846 documents at ``max_length`` 2048, built
from the published Wikipedia length histogram (``shared/data/length-histograms``), random token ids:

- **documents**: each document is 1 + a geometric number (mean 3.3) of Wikipedia sequences back to back: 15 M
  tokens, a long tail (8 % over 2048, split), many short documents to fill gaps;
- **hard**: every document one Wikipedia sequence x 4 (up to 2048, none split, few short ones): best fit leaves
  rows with gaps and the exact repack of those rows runs in full (and finds no better packing here).

``packing_ab.py --corpora`` also takes three more where the repack searches long: ``wiki3`` (Wikipedia x 3),
``squad5`` (SQuAD x 5) and ``lognormal`` (log-normal lengths, mean 840, sigma 0.5).

For each: one plain copy of the token column (``numpy`` copy of its values buffer, what any packer has to write
at least once), ours (``pack_sequences`` then ``as_table`` wrapped in a ``datasets.Dataset``: TRL's output form)
through each fast input form, and TRL's ``pack_dataset(strategy="bfd_split")`` on the same Dataset. Every figure
is the best of ``repeats`` runs, the figures taken in turn (not one after the other), so a busy machine slows them
alike; ratios are within one run. Then where our time goes: best fit, the repack, the rest of the plan, the gather.
"""

from __future__ import annotations

import time

import numpy as np
from packing import HISTOGRAMS, load_histogram

MAX_LENGTH = 2048


def corpus(kind: str, n: int, seed: int = 0) -> np.ndarray:
    """Document lengths (see the module docstring)."""
    rng = np.random.default_rng(seed)
    wiki = load_histogram(HISTOGRAMS / "wikipedia-512.tsv")
    scaled = {"hard": ("wikipedia-512", 4), "wiki3": ("wikipedia-512", 3), "squad5": ("squad-1.1-384", 5)}
    if kind in scaled:
        name, k = scaled[kind]
        return np.maximum(rng.choice(load_histogram(HISTOGRAMS / f"{name}.tsv"), n) * k - rng.integers(0, k, n), 1)
    if kind == "lognormal":
        return np.maximum(rng.lognormal(np.log(840) - 0.125, 0.5, n).astype(np.int64), 1)
    if kind != "documents":
        raise SystemExit(f"corpus {kind!r}: choose documents, hard, {', '.join(list(scaled)[1:])} or lognormal.")
    parts = rng.geometric(0.3, n)
    draws = rng.choice(wiki, int(parts.sum()))
    return np.add.reduceat(draws, np.concatenate([[0], np.cumsum(parts)[:-1]]))


def interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Best time of each function over ``repeats`` rounds, one call of each per round; outputs dropped before the
    next call (a kept output would make the next one fault in fresh pages)."""
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            out = fn()
            best[name] = min(best[name], time.perf_counter() - start)
            del out
    return best


def measure(kind: str, n: int, repeats: int) -> tuple[list[dict], dict]:
    import datasets
    import pyarrow as pa
    import pyarrow.compute as pc

    from lightning_seqmem.batching import pack_sequences
    from lightning_seqmem.batching.bin_packing import best_fit_decreasing, pack_bins

    datasets.disable_progress_bars()
    lengths = corpus(kind, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.random.default_rng(1).integers(4, 32000, int(offsets[-1]), dtype=np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(tokens))
    ds = datasets.Dataset(datasets.table.InMemoryTable(pa.table({"input_ids": column})), fingerprint=f"floor-{kind}")
    forms = {"Dataset": ds, "Arrow ListArray": column, "numpy (flat, offsets)": (tokens, offsets)}

    def ours(data):
        table = pack_sequences(data, MAX_LENGTH).as_table()
        return datasets.Dataset(datasets.table.InMemoryTable(table), fingerprint="packed")  # as datasets.map names

    fns = {"copy": lambda: np.copy(tokens)} | {form: (lambda d=d: ours(d)) for form, d in forms.items()}
    try:
        from trl import pack_dataset

        fns["trl"] = lambda: pack_dataset(ds, MAX_LENGTH, strategy="bfd_split")
    except ImportError:
        pack_dataset = None
    best = interleaved(fns, repeats)
    res = pack_sequences(ds, MAX_LENGTH)
    rows = []
    trl_eff = None
    if pack_dataset is not None:
        packed = pack_dataset(ds, MAX_LENGTH, strategy="bfd_split")
        kept = int(pc.sum(pc.list_value_length(packed.data.column("input_ids"))).as_py())
        trl_eff, trl_lost = kept / (len(packed) * MAX_LENGTH), int(offsets[-1]) - kept
    for form in forms:
        rows.append(
            dict(
                corpus=kind,
                form=form,
                seconds=best[form],
                copy=best["copy"],
                trl=best.get("trl"),
                efficiency=res.efficiency,
                lost=res.tokens_truncated + res.tokens_dropped,
                trl_efficiency=trl_eff,
                trl_lost=trl_lost if trl_eff is not None else None,
            )
        )
    # Where the time goes: best fit alone, best fit + repack, the whole plan, the gather into a table.
    capped = np.minimum(lengths, MAX_LENGTH)
    split = pack_sequences(ds, MAX_LENGTH)
    parts = interleaved(
        {
            "best fit": lambda: best_fit_decreasing(capped, MAX_LENGTH),
            "best fit + repack": lambda: pack_bins(capped, MAX_LENGTH),
            "plan (pack_sequences)": lambda: pack_sequences(ds, MAX_LENGTH),
            "gather (as_table)": lambda: split.as_table(),
            "copy": lambda: np.copy(tokens),
        },
        repeats,
    )
    info = dict(docs=n, tokens=int(offsets[-1]), split=int((lengths > MAX_LENGTH).sum()), rows=res.num_rows)
    return rows, parts | info


def lists_in(n: int) -> tuple[float, float]:
    """Python token lists in (the slow form): converting them, then packing the converted form."""
    from lightning_seqmem.batching import pack_sequences
    from lightning_seqmem.data.tokens import as_token_source

    lengths = corpus("documents", n)
    flat = np.random.default_rng(1).integers(4, 32000, int(lengths.sum()), dtype=np.int32)
    lists = [a.tolist() for a in np.split(flat, np.cumsum(lengths)[:-1])]
    start = time.perf_counter()
    source = as_token_source(lists)
    convert = time.perf_counter() - start
    start = time.perf_counter()
    pack_sequences(source, MAX_LENGTH).as_table()
    return convert, time.perf_counter() - start


def streamed(n: int, repeats: int = 3) -> dict[str, tuple[float, float]]:
    """``StreamingPacker`` (best fit per window of 1,000 documents) over the documents corpus as numpy arrays, rows
    taken and dropped as a loader would, side by side with the same packer turning each row into Python lists (as
    it did before rows became arrays): ``{"arrays" | "lists": (seconds, of which planning)}``, best of
    ``repeats``; also ``"copy"`` (one copy of the tokens) and ``"rows"``."""
    import lightning_seqmem.batching.streaming_packer as streaming

    lengths = corpus("documents", n)
    flat = np.random.default_rng(1).integers(4, 32000, int(lengths.sum()), dtype=np.int32)
    docs = np.split(flat, np.cumsum(lengths)[:-1])
    planning, pop, plan = [0.0], streaming.PackingWindow.pop, streaming.pack_bins

    def pop_lists(window, counts):
        return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in pop(window, counts).items()}

    def timed_plan(*args):
        start = time.perf_counter()
        out = plan(*args)
        planning[0] += time.perf_counter() - start
        return out

    best, rows = {"arrays": (float("inf"), 0.0), "lists": (float("inf"), 0.0)}, 0
    streaming.pack_bins = timed_plan
    try:
        for _ in range(repeats):
            for name, popper in (("arrays", pop), ("lists", pop_lists)):
                streaming.PackingWindow.pop, planning[0] = popper, 0.0
                start = time.perf_counter()
                rows = sum(1 for _ in streaming.StreamingPacker(MAX_LENGTH, buffer_size=1000)(iter(docs)))
                best[name] = min(best[name], (time.perf_counter() - start, planning[0]))
    finally:
        streaming.PackingWindow.pop, streaming.pack_bins = pop, plan
    best["copy"] = interleaved({"copy": lambda: np.copy(flat)}, 5)["copy"]
    best["rows"] = rows
    return best


def main(n: int, repeats: int) -> None:
    results = [measure(kind, n, repeats) for kind in ("documents", "hard")]
    print(f"max_length {MAX_LENGTH}; Dataset/Arrow/numpy in, a Dataset of packed rows out; best of {repeats}\n")
    print("| corpus | input | ours (s) | one copy (s) | ours / copy | TRL bfd_split (s) | TRL / ours |", end="")
    print(" efficiency ours | efficiency TRL | tokens lost ours / TRL |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows, _ in results:
        for r in rows:
            trl = "n/a" if r["trl"] is None else f"{r['trl']:.3f} | {r['trl'] / r['seconds']:.1f}x"
            trl_eff = "n/a" if r["trl_efficiency"] is None else f"{r['trl_efficiency']:.5f}"
            print(
                f"| {r['corpus']} | {r['form']} | {r['seconds']:.4f} | {r['copy']:.4f} | "
                f"{r['seconds'] / r['copy']:.2f}x | {trl if r['trl'] is not None else 'n/a | n/a'} | "
                f"{r['efficiency']:.5f} | {trl_eff} | {r['lost']} / {r['trl_lost']} |"
            )
    print("\nWhere the time goes (best of each; the plan includes best fit and the repack):\n")
    print("| corpus | documents | tokens | split | rows | best fit | + repack | plan | gather | one copy |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for _, p in results:
        print(
            f"| {_[0]['corpus']} | {p['docs']:,} | {p['tokens']:,} | {p['split']:,} | {p['rows']:,} | "
            f"{p['best fit']:.4f} | {p['best fit + repack']:.4f} | {p['plan (pack_sequences)']:.4f} | "
            f"{p['gather (as_table)']:.4f} | {p['copy']:.4f} |"
        )
    convert, pack = lists_in(n)
    print(f"\nPython lists in (documents corpus): converting them {convert:.2f} s, then packing {pack:.3f} s.")
    s = streamed(n)
    for name, label in (("arrays", "rows as int32 arrays"), ("lists", "rows as Python lists, as before")):
        seconds, planning = s[name]
        print(
            f"Streamed (documents corpus, windows of 1,000), {label}: {seconds:.3f} s for {s['rows']:,} rows, of "
            f"which planning {planning:.3f} s; {seconds / s['copy']:.1f}x one copy ({s['copy']:.4f} s)."
        )
