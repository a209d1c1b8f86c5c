"""The packer before and after a change, side by side in one process: ``bin_packing.py`` at a git revision against
the working tree's.

Why: this machine's speed drifts within minutes, so a change to the packer is measured against the code before it in
the same process, the two taking turns (interleaved, best of ``--repeats``), not in runs made at different times.
The revision's ``bin_packing.py`` (with its ``exact_fit.py``) is loaded as a module of its own and swapped into
``pack_sequences`` (the floor benchmark's path: a ``datasets.Dataset`` in, ``as_table()`` wrapped in a Dataset out)
and into the streaming packer. Both must give the same rows: a change that moves a row is not a speed-up.

Command: ``python benchmarks/packing_ab.py --before HEAD~1`` (``--repeats``, ``--documents``, ``--corpora``).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from packing_floor import MAX_LENGTH, corpus, interleaved

ROOT = Path(__file__).resolve().parents[1]


def _source_at(revision: str, path: str) -> str | None:
    """A file's text at a git revision, or ``None`` where it did not exist yet."""
    out = subprocess.run(["git", "show", f"{revision}:{path}"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else None


def _load(name: str, source: str):
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def module_at(revision: str):
    """``lightning_seqmem/batching/bin_packing.py`` as it was at ``revision``, loaded as a separate module, with the
    repack's search (``exact_fit.py``, once it had a file of its own) from the same revision."""
    packer = _source_at(revision, "lightning_seqmem/batching/bin_packing.py")
    if packer is None:  # a revision git does not know, or one before the packer existed
        raise SystemExit(
            f"--before {revision}: no lightning_seqmem/batching/bin_packing.py there; give a commit of this "
            "repository that has it (git log --oneline -- lightning_seqmem/batching/bin_packing.py)."
        )
    module = _load("bin_packing_before", packer)
    search = _source_at(revision, "lightning_seqmem/batching/exact_fit.py")
    if search is not None:  # else the search is in bin_packing.py itself
        module.exact_fit_patterns = _load("exact_fit_before", search).exact_fit_patterns
    return module


def main(before_rev: str, n: int, repeats: int, corpora: list[str]) -> None:
    import datasets
    import pyarrow as pa

    import lightning_seqmem.batching.packed_rows as packed_rows
    import lightning_seqmem.batching.streaming_packer as streaming
    from lightning_seqmem.batching import bin_packing as after

    datasets.disable_progress_bars()
    before = module_at(before_rev)
    modules = {"before": before, "after": after}
    print(f"bin_packing.py at {before_rev} (before) and in the working tree (after); best of {repeats}, interleaved\n")
    print(
        "| corpus | `pack_bins` before → after (s) | ours before → after (s) | ours / one copy | one copy (s) |", end=""
    )
    print(" same rows |\n|---|---:|---:|---:|---:|---|")
    for kind in corpora:
        lengths = corpus(kind, n)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        tokens = np.random.default_rng(1).integers(4, 32000, int(offsets[-1]), dtype=np.int32)
        column = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(tokens))
        ds = datasets.Dataset(datasets.table.InMemoryTable(pa.table({"input_ids": column})), fingerprint=f"ab-{kind}")
        capped = np.minimum(lengths, MAX_LENGTH)

        def ours(module):
            packed_rows.pack_bins = module.pack_bins
            table = packed_rows.pack_sequences(ds, MAX_LENGTH).as_table()
            return datasets.Dataset(datasets.table.InMemoryTable(table), fingerprint="packed")

        fns = {"copy": lambda: np.copy(tokens)}
        for name, module in modules.items():
            fns[name] = lambda m=module: ours(m)
            fns[f"bins {name}"] = lambda m=module: m.pack_bins(capped, MAX_LENGTH)
        try:
            best = interleaved(fns, repeats)
        finally:
            packed_rows.pack_bins = after.pack_bins
        plans = [m.pack_bins(capped, MAX_LENGTH) for m in modules.values()]
        same = all(np.array_equal(a, b) for a, b in zip(*plans))
        copy = best["copy"]
        print(
            f"| {kind} | {best['bins before']:.4f} → {best['bins after']:.4f} | {best['before']:.4f} → "
            f"{best['after']:.4f} | {best['before'] / copy:.2f}x → **{best['after'] / copy:.2f}x** | {copy:.4f} | "
            f"{'yes' if same else 'NO'} |"
        )

    lengths = corpus("documents", n)
    flat = np.random.default_rng(1).integers(4, 32000, int(lengths.sum()), dtype=np.int32)
    docs = np.split(flat, np.cumsum(lengths)[:-1])

    def stream(module):
        streaming.pack_bins = module.pack_bins
        return [row["seq_lengths"] for row in streaming.StreamingPacker(MAX_LENGTH, buffer_size=1000)(iter(docs))]

    try:
        best = interleaved(
            {"copy": lambda: np.copy(flat)} | {k: (lambda m=m: stream(m)) for k, m in modules.items()}, 7
        )
        same = stream(before) == stream(after)
    finally:
        streaming.pack_bins = after.pack_bins
    copy = best["copy"]
    print(
        f"\nStreamed (documents corpus, windows of 1,000): {best['before']:.3f} → {best['after']:.3f} s, "
        f"{best['before'] / copy:.1f}x → {best['after'] / copy:.1f}x one copy ({copy:.4f} s); same rows: "
        f"{'yes' if same else 'NO'}."
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="HEAD~1", help="git revision of the packer to compare against")
    parser.add_argument("--documents", type=int, default=17_846)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument(
        "--corpora", default="documents,hard", help="comma-separated: documents, hard, wiki3, squad5, lognormal"
    )
    args = parser.parse_args()
    sys.exit(main(args.before, args.documents, args.repeats, args.corpora.split(",")))
