"""Conversations: tokenizing chat data, ours vs TRL's SFTTrainer, and what packing does to the trained share.

The same on-disk ``datasets.Dataset`` of conversations (generated deterministically: 2 to 12 turns, one in three
with a system message, words from a fixed vocabulary) and the same tokenizer (the built-in BPE with its ChatML-style
template, which has ``{% generation %}`` markers) go into two fresh processes each:

- TRL: ``SFTTrainer(args=SFTConfig(assistant_only_loss=True, max_length=...), train_dataset=ds,
  processing_class=tok)`` (a one-layer Llama from a config), i.e. its dataset preparation: ``input_ids`` and the
  assistant mask of every conversation.
- ours: ``SeqMemDataModule(dataset=ds, tokenizer=tok, max_length=..., strategy="pad")``, ``prepare_data()`` (the
  tokenize-once cache: ``input_ids``, trained spans, turn ends) and ``setup("fit")`` (truncation by turns, rows).

Both tokenize with one process (``num_proc`` 1, ``TOKENIZERS_PARALLELISM=false``); ours tokenizes on two threads of
its own while its main thread renders (the Rust tokenizer releases the GIL), TRL one conversation at a time. CPU is
the child's user + system time (all its threads): on a busy machine it moves less than wall. Wall is the whole child
process; peak RSS its own ``VmHWM`` (one process: no workers); "after imports" is what the pipeline adds to the RSS its imports left (TRL's
import and ours both load torch; ours also Lightning). Then, from our cache, token efficiency and the share of fed
tokens that carry loss, pad vs pack, at ``max_length``.

With ``--pairs``: conversation-form preference pairs (the conversation up to its last assistant turn as the prompt,
that turn as ``chosen``, another answer as ``rejected``) through TRL's ``DPOTrainer`` dataset preparation against
``SeqMemDataModule`` (``prepare_data`` + ``setup``), the same way: fresh processes, one tokenizing process each.

    python benchmarks/chat.py                 # 100 k conversations, max_length 2048
    python benchmarks/chat.py --rows 5000     # smoke test
    python benchmarks/chat.py --pairs         # 100 k conversation pairs vs TRL's DPOTrainer
    python benchmarks/chat.py --num-proc 2    # ours with two tokenizing processes
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_START = time.perf_counter()
GIB = 1 << 30
from chat_data import conversations, pairs  # noqa: E402 (benchmarks/chat_data.py, beside this file)


def _resident(field: str = "VmRSS") -> int:
    """This process's resident set now (``VmRSS``) or its peak (``VmHWM``), bytes. Not ``ru_maxrss``: Linux keeps
    that across ``execve``, so a child would report the peak of the parent it was forked from."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _tokenizer():
    from lightning_seqmem.data.tokenizer import load_tokenizer

    return load_tokenizer()  # the built-in BPE and its chat template (generation markers)


def child_trl(task: dict) -> dict:
    import datasets
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    imported, import_rss = time.perf_counter(), _resident()
    ds, tok = datasets.load_from_disk(task["data"]), _tokenizer()
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    args = SFTConfig(
        output_dir=task["scratch"],
        assistant_only_loss=True,
        max_length=task["max_length"],
        report_to="none",
        use_cpu=True,
        dataset_num_proc=None,
    )
    prepared = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok).train_dataset
    import pyarrow.compute as pc

    tokens = int(pc.sum(pc.list_value_length(prepared.data.column("input_ids"))).as_py())
    labels = pc.list_flatten(prepared.data.column("labels"))
    trained = int(pc.sum(pc.cast(pc.not_equal(labels, -100), "int64")).as_py())
    return {
        "rows": len(prepared),
        "tokens": tokens,
        "trained": trained,
        "import_s": imported - T_START,
        "import_rss": import_rss,
        "pipeline_s": time.perf_counter() - imported,
    }


def _prepared(task: dict):
    """Our side: the DataModule on the saved dataset, tokenized through its cache and set up (rows planned)."""
    import datasets

    from lightning_seqmem import SeqMemDataModule

    ds, tok = datasets.load_from_disk(task["data"]), _tokenizer()
    dm = SeqMemDataModule(
        dataset=ds,
        tokenizer=tok,
        max_length=task["max_length"],
        strategy="pad",
        cache_dir=task["cache_dir"],
        num_proc=task.get("num_proc", 1),
    )
    dm.prepare_data()
    dm.setup("fit")
    return dm


def _pair_counts(prepared) -> dict:
    """Pairs, tokens (the prompt once per sequence) and completion tokens of TRL's three token columns."""
    import pyarrow.compute as pc

    count = {
        c: int(pc.sum(pc.list_value_length(prepared.data.column(c))).as_py())
        for c in ("prompt_ids", "chosen_ids", "rejected_ids")
    }
    return {
        "rows": len(prepared),
        "tokens": 2 * count["prompt_ids"] + count["chosen_ids"] + count["rejected_ids"],
        "trained": count["chosen_ids"] + count["rejected_ids"],
    }


def _import_ours() -> None:
    """Our imports, before the clock starts (TRL's children import theirs the same way)."""
    import datasets  # noqa: F401

    from lightning_seqmem import SeqMemDataModule  # noqa: F401 (the package imports lazily: this loads it)


def child_ours(task: dict) -> dict:
    _import_ours()
    imported, import_rss = time.perf_counter(), _resident()
    stats = _prepared(task).stats()
    rows = sum(s["rows"] for s in stats.values())
    tokens = sum(s["tokens"] - s["tokens_truncated"] - s["tokens_dropped"] for s in stats.values())
    trained = sum(s["trained_tokens"] for s in stats.values())
    return {
        "rows": rows,
        "tokens": tokens,
        "trained": trained,
        "import_s": imported - T_START,
        "import_rss": import_rss,
        "pipeline_s": time.perf_counter() - imported,
    }


def child_trl_pairs(task: dict) -> dict:
    import datasets
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    imported, import_rss = time.perf_counter(), _resident()
    ds, tok = datasets.load_from_disk(task["data"]), _tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    args = DPOConfig(
        output_dir=task["scratch"], max_length=task["max_length"], report_to="none", use_cpu=True, dataset_num_proc=None
    )
    prepared = DPOTrainer(
        model=LlamaForCausalLM(config),
        ref_model=LlamaForCausalLM(config),
        args=args,
        train_dataset=ds,
        processing_class=tok,
    ).train_dataset
    elapsed = time.perf_counter() - imported
    return {**_pair_counts(prepared), "import_s": imported - T_START, "import_rss": import_rss, "pipeline_s": elapsed}


def child_ours_pairs(task: dict) -> dict:
    _import_ours()
    imported, import_rss = time.perf_counter(), _resident()
    dm = _prepared(task)  # truncation planned and rows ready to serve: more than TRL's preparation does
    elapsed = time.perf_counter() - imported
    tokenized = dm.tokenized_documents()[0]["train"]  # every pair, before truncation (TRL's columns)
    return {**_pair_counts(tokenized), "import_s": imported - T_START, "import_rss": import_rss, "pipeline_s": elapsed}


def child_strategies(task: dict) -> dict:
    """Token efficiency and trained share, pad vs pack, from the cache ``child_ours`` wrote."""
    import datasets

    from lightning_seqmem import SeqMemDataModule

    ds, tok = datasets.load_from_disk(task["data"]), _tokenizer()
    out = {}
    for strategy in ("pad", "pack"):
        dm = SeqMemDataModule(
            dataset=ds,
            tokenizer=tok,
            max_length=task["max_length"],
            strategy=strategy,
            micro_batch_size=task["micro_batch_size"],
            cache_dir=task["cache_dir"],
        )
        dm.setup("fit")
        train = dm.stats()["train"]
        out[strategy] = {
            k: train[k]
            for k in (
                "rows",
                "batches",
                "token_efficiency",
                "trained_share",
                "trained_tokens",
                "tokens_truncated",
                "tokens_dropped",
            )
        }
        out[strategy]["trained_per_slot"] = train["token_efficiency"] * train["trained_share"]
    return out


def run_child(kind: str, task: dict, env: dict) -> dict:
    """One child in a fresh process: its wall, and the peak RSS it reports (its own ``VmHWM``)."""
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as out:
        result_path = out.name
    start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--child", kind, json.dumps(task), result_path],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = proc.communicate()
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise RuntimeError(f"{kind} failed:\n{stderr[-3000:]}")
    result = json.load(open(result_path))
    os.unlink(result_path)
    result.update(wall_s=wall, cpu_s=sum(getattr(after, f) - getattr(before, f) for f in ("ru_utime", "ru_stime")))
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--scratch", default=None, help="working folder (default: a temporary one)")
    parser.add_argument("--pairs", action="store_true", help="conversation pairs: ours vs TRL's DPOTrainer")
    parser.add_argument("--num-proc", type=int, default=1, help="tokenizing processes on our side (TRL: one)")
    parser.add_argument("--ours-only", action="store_true", help="our side only (e.g. to compare --num-proc)")
    args = parser.parse_args(argv)

    import datasets

    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="chat-bench-"))
    data = scratch / ("pairs" if args.pairs else "conversations")
    if not data.exists():
        rows = pairs(args.rows) if args.pairs else conversations(args.rows)
        datasets.Dataset.from_list(list(rows)).save_to_disk(str(data))
    _tokenizer()  # trained once and cached before any timing
    env = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_DATASETS_CACHE": str(scratch / "hf"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    }
    task = {
        "data": str(data),
        "max_length": args.max_length,
        "micro_batch_size": args.micro_batch_size,
        "scratch": str(scratch / "trl"),
        "cache_dir": str(scratch / "cache"),
        "num_proc": args.num_proc,
    }
    results = {}
    for side in ("ours",) if args.ours_only else ("trl", "ours"):  # each a fresh process, cold: no cache left
        shutil.rmtree(scratch / "hf", ignore_errors=True)
        shutil.rmtree(scratch / "cache", ignore_errors=True)
        for leftover in data.glob("cache-*.arrow"):  # datasets.map writes its cache next to a saved dataset
            leftover.unlink()
        results[side] = run_child(side + ("_pairs" if args.pairs else ""), task, env)
    what = "conversation pairs (prompt of 1-11 turns)" if args.pairs else "conversations of 2-12 turns"
    print(f"{args.rows:,} {what}, max_length {args.max_length}, one process each side\n")
    trained = "completion tokens" if args.pairs else "trained tokens"
    print(
        f"| | wall (s) | CPU (s) | imports (s) | peak RSS (GiB) | RSS after imports (GiB) | rows | tokens | {trained} |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for side, r in results.items():
        print(
            f"| {side} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['import_s']:.1f} | {r['peak_rss'] / GIB:.2f} | "
            f"{(r['peak_rss'] - r['import_rss']) / GIB:.3f} | {r['rows']:,} | {r['tokens']:,} | {r['trained']:,} |"
        )
    if args.ours_only:
        return
    t, o = results["trl"], results["ours"]
    print(
        f"\nours / TRL: wall {o['wall_s'] / t['wall_s']:.2f}x, pipeline wall {o['pipeline_s'] / t['pipeline_s']:.2f}x, "
        f"CPU {o['cpu_s'] / t['cpu_s']:.2f}x, "
        f"peak RSS {o['peak_rss'] / t['peak_rss']:.2f}x, RSS after imports "
        f"{(o['peak_rss'] - o['import_rss']) / max(t['peak_rss'] - t['import_rss'], 1):.2f}x"
    )
    if args.pairs:
        return

    strategies = run_child("strategies", task, env)
    print(f"\nAt max_length {args.max_length}, micro_batch_size {args.micro_batch_size} (train split):\n")
    print("| strategy | rows | batches | token efficiency | trained share of fed tokens | trained tokens per slot |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, s in ((k, v) for k, v in strategies.items() if k in ("pad", "pack")):
        print(
            f"| {name} | {s['rows']:,} | {s['batches']:,} | {s['token_efficiency']:.4f} | "
            f"{s['trained_share']:.4f} | {s['trained_per_slot']:.4f} |"
        )


def _child_main(kind: str, task_json: str, result_path: str) -> None:
    result = {
        "trl": child_trl,
        "ours": child_ours,
        "strategies": child_strategies,
        "trl_pairs": child_trl_pairs,
        "ours_pairs": child_ours_pairs,
    }[kind](json.loads(task_json))
    result["peak_rss"] = _resident("VmHWM")
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child_main(*sys.argv[2:5])
    else:
        main()
