"""Streaming benchmark: one pass over jsonl files read as a stream, packed into rows, batched as a trainer gets them.

The same files (a synthetic corpus: log-normal document lengths, words from a fixed vocabulary, deterministic by
seed, split into ``--files`` jsonl files), the same tokenizer (the built-in BPE) and the same framing, each side in
a fresh process, at two corpus sizes:

- **TRL**: ``load_dataset("json", streaming=True)``, ``.map`` tokenization, ``trl.pack_dataset(strategy="bfd_split")``
  (best fit over windows of 1,000 documents, long documents split: nothing lost), rows grouped by the micro-batch
  and passed through TRL's padding-free collator (``DataCollatorForLanguageModeling(padding_free=True)``), as
  ``SFTTrainer`` feeds its model.
- **ours**: ``SeqMemDataModule(dataset=<files>, streaming=True, strategy="pack", streaming_buffer_size=1000)``, its
  ``train_dataloader()`` to the end (best fit over the same window, long documents split); again with
  ``num_workers=2`` (``datasets`` deals the files out to the two workers: each document read once).

Reported per side and size: wall for the pass (imports excluded), tokens per second, peak RSS above the RSS once
imported (``ru_maxrss`` of the child, exact), and row fill (real tokens / rows x max_length). The RSS column at
two sizes shows whether memory grows with the corpus (a stream's should not).

    python benchmarks/streaming.py                       # 20 k and 80 k documents, 8 files, max_length 512
    python benchmarks/streaming.py --sizes 5000 --files 4
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

WORDS = [f"w{i}" for i in range(3000)]
SIDES = {"trl": "TRL", "ours": "ours", "ours_workers": "ours, num_workers=2"}


def write_corpus(directory: str, documents: int, files: int, seed: int = 0) -> list[str]:
    """``files`` jsonl files of ``documents`` documents in all (log-normal lengths in words, a heavy tail)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(4.6, 0.9, documents).astype(int), 1, 6000)
    words = rng.integers(0, len(WORDS), int(lengths.sum()))
    paths = [os.path.join(directory, f"part-{f:03d}.jsonl") for f in range(files)]
    handles = [open(p, "w") for p in paths]
    start = 0
    for i, n in enumerate(lengths):
        handles[i % files].write(json.dumps({"text": " ".join(WORDS[w] for w in words[start : start + n])}) + "\n")
        start += n
    for h in handles:
        h.close()
    return paths


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(side: str, paths: list[str], max_length: int, rows: int) -> dict:
    """One pass in this process; returns the figures."""
    import datasets

    datasets.disable_progress_bars()
    from lightning_seqmem import SeqMemDataModule
    from lightning_seqmem.batching.collate import real_token_mask
    from lightning_seqmem.data.encode import document_frame
    from lightning_seqmem.data.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    if side == "trl":
        import torch
        import trl
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
    imported, start = _rss_mib(), time.perf_counter()
    real = slots = packed_rows = 0
    if side.startswith("ours"):
        dm = SeqMemDataModule(
            dataset=paths,
            streaming=True,
            strategy="pack",
            max_length=max_length,
            micro_batch_size=rows,
            streaming_buffer_size=1000,
            streaming_validation_documents=0,
            num_workers=2 if side == "ours_workers" else 0,
        )
        dm.setup("fit")
        for batch in dm.train_dataloader():
            real += int(real_token_mask(batch, dm.pad_token_id).sum())
            packed_rows += batch["input_ids"].shape[0]
        tokens = dm.stats()["train"]["tokens"]
    else:
        prefix, suffix = document_frame(tok)
        stream = datasets.load_dataset("json", data_files={"train": paths}, streaming=True)["train"]
        stream = stream.map(
            lambda b: {
                "input_ids": [prefix + ids + suffix for ids in tok(b["text"], add_special_tokens=False)["input_ids"]]
            },
            batched=True,
            remove_columns=["text"],
        )
        packed = trl.pack_dataset(stream, max_length, strategy="bfd_split")
        collate = DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id, padding_free=True)
        group = []
        for row in packed:
            group.append({"input_ids": list(row["input_ids"]), "seq_lengths": list(row["seq_lengths"])})
            if len(group) == rows:
                batch = collate(group)
                real += int(batch["input_ids"].numel())
                packed_rows += len(group)
                group = []
        if group:
            real += int(collate(group)["input_ids"].numel())
            packed_rows += len(group)
        tokens = real
        del torch
    wall = time.perf_counter() - start
    slots = packed_rows * max_length
    worker = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the largest loader worker, if any
    return {
        "wall_s": wall,
        "tokens": tokens,
        "real": real,
        "rows": packed_rows,
        "fill": real / max(slots, 1),
        "rss_mib": _rss_mib() - imported,
        "worker_rss_mib": worker,
    }


def run(side: str, paths: list[str], max_length: int, rows: int) -> dict:
    code = (
        f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import streaming as s; "
        f"print(json.dumps(s.child({side!r}, {paths!r}, {max_length}, {rows})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"{side} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[20_000, 80_000])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--rows", type=int, default=8)
    args = parser.parse_args()
    print(
        "| documents | tokens | side | pass wall s | tokens/s | peak RSS above imports MiB | row fill | ours / TRL wall |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            paths = write_corpus(tmp, size, args.files)
            results = {side: run(side, paths, args.max_length, args.rows) for side in SIDES}
        for side, label in SIDES.items():
            r = results[side]
            ratio = f"{r['wall_s'] / results['trl']['wall_s']:.2f}x" if side != "trl" else ""
            extra = f" (+ 2 workers, {r['worker_rss_mib']:.0f} each, imports included)"
            rss = f"{r['rss_mib']:.0f}" + (extra if side == "ours_workers" else "")
            print(
                f"| {size:,} | {r['tokens']:,} | {label} | {r['wall_s']:.1f} | {r['real'] / r['wall_s']:,.0f} | "
                f"{rss} | {r['fill']:.4f} | {ratio} |"
            )


if __name__ == "__main__":
    main()
