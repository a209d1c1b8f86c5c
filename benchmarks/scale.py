"""Scale benchmark: the map-style data path on 150 k to 2.5 M documents, side by side with TRL's pipeline.

On the same on-disk ``datasets.Dataset`` (a synthetic corpus: log-normal document lengths with a heavy tail, words
from a fixed vocabulary, deterministic by seed) and the same word-level tokenizer (built offline), each figure from
a fresh process:

- **TRL**: ``datasets.map`` tokenization (``num_proc``) + ``trl.pack_dataset(strategy="bfd_split")`` (same
  ``num_proc``), the packed Dataset as TRL returns it, then its first micro-batch through TRL's own padding-free
  collator (``DataCollatorForLanguageModeling(padding_free=True)``: tensors, as ``SFTTrainer`` feeds its model).
- **ours**: ``SeqMemDataModule(dataset=ds, tokenizer=tok, strategy="pack", max_length=...)`` (with ``num_proc`` and
  ``cache_dir`` where the DataModule takes them), ``prepare_data()``, ``setup("fit")``, ``stats()``, the first
  batch of ``train_dataloader()``.

Each side runs twice: cold (map caches removed, fresh cache dirs) and warm (the caches the cold run left). Wall is
the child process from start to exit (imports included). Each child also notes when its library imports were done
and its RSS then; the "pipeline" figures subtract those (wall after the imports; peak RSS above the RSS once
imported): what the data path itself costs in a process that loads its libraries anyway. Peak RSS is that of the
largest single process of the child's tree (``wait4`` ``ru_maxrss``, exact); peak anonymous RSS (polled every
50 ms) leaves out the pages of memory-mapped Arrow files, which the kernel can drop; the tree figures sum over the
``num_proc`` workers too
(shared pages counted once per process). Also: ``pack_sequences`` on a ``datasets.Dataset`` column (packed tokens materialised) against
``pack_dataset`` on the same Dataset, lengths drawn from a published length histogram; and the RSS growth of ours
per extra million tokens, fitted over the sizes run.

    python benchmarks/scale.py                    # 150 k and 300 k documents, TRL and ours, cold and warm
    python benchmarks/scale.py --quick            # 5 k documents: a smoke test (about a minute, mostly imports)
    python benchmarks/scale.py --big              # 2.5 M documents (~1 B tokens), ours only: stages, peak RSS
    python benchmarks/scale.py --big --pretokenized   # the same corpus as input_ids: no tokenizer call
    python benchmarks/scale.py --ours-path /work/wt9 --sizes 150000 --num-proc 2

``--ours-path`` puts another checkout first on ``PYTHONPATH`` for the "ours" processes only. A child whose tree
grows past ``--rss-limit-gib`` is killed and reported as such (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_START = time.perf_counter()  # a child's clock starts here, before its libraries are imported

import numpy as np  # noqa: E402 (after the clock starts)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_DATA_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lightning_seqmem" / "scale-bench"
SPECIALS = {"pad_token": "[PAD]", "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]"}
GIB = 2**30

# ------------------------------------------------------------------------------------------- synthetic corpus


def word_vocabulary(size: int, seed: int = 0) -> list[str]:
    """``size`` distinct lowercase words of 2 to 9 letters, the same for the same seed."""
    rng = np.random.default_rng([seed, 1])
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words: dict[str, None] = {}
    while len(words) < size:
        for n in rng.integers(2, 10, size):
            words.setdefault("".join(rng.choice(letters, n)), None)
            if len(words) == size:
                break
    return list(words)


def document_lengths(
    n_docs: int, seed: int = 0, median: float = 220.0, sigma: float = 1.1, longest: int = 32768
) -> np.ndarray:
    """Words per document: log-normal (median ``median``, mean ~1.8x that) with its heavy right tail, ``int64[n]``."""
    rng = np.random.default_rng([seed, 2])
    return np.clip(rng.lognormal(np.log(median), sigma, n_docs), 1, longest).astype(np.int64)


def document_texts(lengths: np.ndarray, vocabulary: list[str], seed: int, chunk: int):
    """The texts of documents ``chunk*k ...`` as a pyarrow ``StringArray``: uniform words joined by spaces."""
    import pyarrow as pa
    import pyarrow.compute as pc

    rng = np.random.default_rng([seed, 3, chunk])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = rng.integers(0, len(vocabulary), int(offsets[-1]), dtype=np.int32)
    words = pc.take(pa.array(vocabulary, pa.string()), pa.array(ids))
    return pc.binary_join(pa.LargeListArray.from_arrays(pa.array(offsets), words), " ")


def document_tokens(lengths: np.ndarray, vocab_size: int, seed: int, chunk: int):
    """What the tokenizer makes of :func:`document_texts` (same seed, same chunk), ``[BOS] words [EOS]`` per document,
    as a pyarrow ``ListArray`` of int32: the pre-tokenized corpus, built without a tokenizer call."""
    import pyarrow as pa

    rng = np.random.default_rng([seed, 3, chunk])
    n_words = int(lengths.sum())
    ids = rng.integers(0, vocab_size, n_words, dtype=np.int32) + len(SPECIALS)  # word i has id i + 4
    offsets = np.concatenate([[0], np.cumsum(lengths + 2)]).astype(np.int32)
    flat = np.empty(int(offsets[-1]), dtype=np.int32)
    flat[offsets[:-1]] = 1  # [BOS]
    flat[offsets[1:] - 1] = 2  # [EOS]
    inside = np.ones(len(flat), dtype=bool)
    inside[offsets[:-1]] = inside[offsets[1:] - 1] = False
    flat[inside] = ids
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))


def build_tokenizer(vocabulary: list[str]):
    """A word-level ``PreTrainedTokenizerFast`` over ``vocabulary`` (specials first: pad 0, bos 1, eos 2, unk 3),
    built offline: no training, no download."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS.values())}
    vocab.update({word: i + len(vocab) for i, word in enumerate(vocabulary)})
    tok = Tokenizer(WordLevel(vocab, unk_token=SPECIALS["unk_token"]))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1_000_000, **SPECIALS)


def write_corpus(
    n_docs: int,
    data_dir: Path,
    seed: int = 0,
    vocab_size: int = 32000,
    chunk_docs: int = 10_000,
    pretokenized: bool = False,
) -> Path:
    """Write ``corpus.arrow`` (one ``text`` column, Arrow stream format, read memory-mapped by
    ``datasets.Dataset.from_file``) and ``tokenizer/`` under ``data_dir/docs-<n>-seed-<seed>``; reuse them if present.
    With ``pretokenized``, ``corpus.arrow`` holds the ``input_ids`` the tokenizer would make instead (folder name
    ending ``-tokens``).

    Returns the folder; ``meta.json`` in it has the document and word counts."""
    import pyarrow as pa

    folder = data_dir / f"docs-{n_docs}-seed-{seed}{'-tokens' if pretokenized else ''}"
    meta_path = folder / "meta.json"
    if meta_path.exists():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocabulary = word_vocabulary(vocab_size, seed)
    build_tokenizer(vocabulary).save_pretrained(tmp / "tokenizer")
    lengths = document_lengths(n_docs, seed)
    schema = pa.schema([("input_ids", pa.list_(pa.int32()))] if pretokenized else [("text", pa.large_string())])
    with pa.OSFile(str(tmp / "corpus.arrow"), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for chunk, start in enumerate(range(0, n_docs, chunk_docs)):
            part = lengths[start : start + chunk_docs]
            column = (
                document_tokens(part, vocab_size, seed, chunk)
                if pretokenized
                else document_texts(part, vocabulary, seed, chunk)
            )
            writer.write_batch(pa.record_batch([column], schema=schema))
    meta = {
        "documents": n_docs,
        "words": int(lengths.sum()),
        "seed": seed,
        "vocab_size": vocab_size,
        "longest_document_words": int(lengths.max()),
        "pretokenized": pretokenized,
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def clear_map_caches(corpus: Path) -> None:
    """Remove the ``datasets.map`` cache files written next to ``corpus.arrow`` (a cold start for the next run)."""
    for path in corpus.glob("cache-*.arrow"):
        path.unlink()


# ------------------------------------------------------------------------------------------- child processes


def _load(corpus: Path):
    import datasets
    from transformers import PreTrainedTokenizerFast

    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_file(str(corpus / "corpus.arrow"))
    return ds, PreTrainedTokenizerFast.from_pretrained(str(corpus / "tokenizer"), local_files_only=True)


def _import_loaders() -> None:
    """What ``_load`` needs, imported before a child marks its imports done: both sides load the same corpus and
    tokenizer, so neither side's "pipeline" figures carry the other's library imports (TRL's import pulls in
    ``transformers``' tokenizer classes; ours imports them lazily)."""
    import datasets  # noqa: F401
    from transformers import PreTrainedTokenizerFast  # noqa: F401


def _resident() -> int:
    """This process's resident set now, bytes (Linux ``/proc``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def child_trl(task: dict) -> dict:
    """TRL's pipeline: tokenize with ``datasets.map`` (EOS/BOS framing as ours), ``pack_dataset(bfd_split)``, then
    the first micro-batch through TRL's own padding-free collator (tensors, as ``SFTTrainer`` feeds its model)."""
    import pyarrow.compute as pc
    from trl import pack_dataset
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    _import_loaders()
    imported, import_rss = time.perf_counter(), _resident()
    ds, tok = _load(Path(task["corpus"]))
    start = time.perf_counter()
    bos, eos = tok.bos_token_id, tok.eos_token_id

    def tokenize(batch):
        ids = tok(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [[bos, *x, eos] for x in ids]}

    num_proc = task["num_proc"] if task["num_proc"] > 1 else None
    if "input_ids" in ds.column_names:  # a pre-tokenized corpus: nothing to tokenize
        tokenized = ds
    else:
        tokenized = ds.map(tokenize, batched=True, num_proc=num_proc, remove_columns=ds.column_names)
    t_tok = time.perf_counter()
    packed = pack_dataset(tokenized, task["max_length"], strategy="bfd_split", map_kwargs={"num_proc": num_proc})
    t_pack = time.perf_counter()
    collate = DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id, padding_free=True)
    batch = collate([packed[i] for i in range(min(task["micro_batch_size"], len(packed)))])
    t_first = time.perf_counter()
    tokens = int(pc.sum(pc.list_value_length(tokenized.data.column("input_ids"))).as_py())
    kept = int(pc.sum(pc.list_value_length(packed.data.column("input_ids"))).as_py())
    return {
        "tokens": tokens,
        "tokens_lost": tokens - kept,
        "rows": len(packed),
        "token_efficiency": kept / (len(packed) * task["max_length"]),
        "batch_shape": list(batch["input_ids"].shape),
        "import_s": imported - T_START,
        "import_rss": import_rss,
        "stages": {"tokenize": t_tok - start, "plan": t_pack - t_tok, "first_batch": t_first - t_pack},
    }


def child_ours(task: dict) -> dict:
    """``SeqMemDataModule``: prepare_data (tokenize), setup (plan), stats, first batch."""
    import inspect

    from lightning_seqmem import SeqMemDataModule

    _import_loaders()
    imported, import_rss = time.perf_counter(), _resident()
    ds, tok = _load(Path(task["corpus"]))
    start = time.perf_counter()
    params = inspect.signature(SeqMemDataModule).parameters
    extra = {k: v for k, v in (("num_proc", task["num_proc"]), ("cache_dir", task["cache_dir"])) if k in params}
    dm = SeqMemDataModule(
        dataset=ds,
        tokenizer=tok,
        strategy="pack",
        max_length=task["max_length"],
        micro_batch_size=task["micro_batch_size"],
        **extra,
    )
    dm.prepare_data()
    t_prepare = time.perf_counter()
    dm.setup("fit")
    t_setup = time.perf_counter()
    stats = dm.stats()
    batch = next(iter(dm.train_dataloader()))
    t_first = time.perf_counter()
    splits = [s for s in stats.values() if isinstance(s, dict)]
    return {
        "tokens": int(sum(s.get("tokens", 0) for s in splits)),
        "tokens_lost": int(sum(s.get("tokens_truncated", 0) + s.get("tokens_dropped", 0) for s in splits)),
        "rows": int(sum(s.get("rows", 0) for s in splits)),
        "token_efficiency": float(stats["train"]["token_efficiency"]),
        "batch_shape": list(batch["input_ids"].shape),
        "api": sorted(extra),
        "import_s": imported - T_START,
        "import_rss": import_rss,
        "lightning_seqmem": str(Path(inspect.getfile(SeqMemDataModule)).parents[1]),
        "stages": {"tokenize": t_prepare - start, "plan": t_setup - t_prepare, "first_batch": t_first - t_setup},
    }


def pack_column(ds, max_length: int):
    """Ours on a Dataset: ``pack_sequences`` through its richest public input form, packed tokens materialised.

    The output timed is the one closest to TRL's, whose ``pack_dataset`` returns a Dataset with the columns
    ``input_ids`` (the packed rows, every token copied) and ``seq_lengths``: where the checkout has
    ``PackResult.as_table`` (those two columns as an Arrow table, tokens copied on threads), that table wrapped in
    a ``datasets.Dataset`` (given a fingerprint, as ``datasets.map`` gives its results: without one, ``datasets``
    hashes the whole table, 0.5 s); else ``res.as_arrow()`` (one list array), else ``res.input_ids``.
    Returns ``(PackResult, what was timed, seconds spent planning)``."""
    import datasets

    from lightning_seqmem.batching import pack_sequences

    start = time.perf_counter()
    try:
        res, form = pack_sequences(ds, max_length), "Dataset"
    except (TypeError, ValueError, KeyError):
        res, form = pack_sequences(ds["input_ids"], max_length), "ds['input_ids']"
    plan_s = time.perf_counter() - start
    if hasattr(res, "as_table"):
        fingerprint = f"{ds._fingerprint}-packed-{max_length}"
        _ = datasets.Dataset(datasets.table.InMemoryTable(res.as_table()), fingerprint=fingerprint)
        return res, f"Dataset(pack_sequences({form}).as_table())", plan_s
    if hasattr(res, "as_arrow"):
        _ = res.as_arrow()  # the packed rows, tokens copied
        return res, f"pack_sequences({form}).as_arrow()", plan_s
    _ = res.input_ids
    return res, f"pack_sequences({form}).input_ids", plan_s


def child_pack(task: dict) -> dict:
    """``pack_sequences`` vs ``pack_dataset(bfd_split)`` on the same in-memory Dataset: best of ``repeats``.

    Each side runs once untimed (a warm-up), then ``repeats`` times in a row, the previous output released before
    the next call (as ``timeit`` does). Why: on this VM the first touch of memory the kernel has handed back to
    the host costs up to 0.5 s per 200 MB (the packed tokens), which swamps the work being measured in the first
    calls of a fresh process and in any call that keeps the previous output alive. Every call's time is
    reported, the warm-up's first."""
    import datasets
    import pyarrow as pa
    import pyarrow.compute as pc
    from trl import pack_dataset

    sys.path.insert(0, str(HERE))
    from packing import HISTOGRAMS, load_histogram  # benchmarks/packing.py

    datasets.disable_progress_bars()
    rng = np.random.default_rng(task["seed"])
    lengths = rng.choice(load_histogram(HISTOGRAMS / task["histogram"]), task["documents"])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    tokens = rng.integers(4, 32000, int(offsets[-1]), dtype=np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens))
    ds = datasets.Dataset(datasets.table.InMemoryTable(pa.table({"input_ids": column})))
    max_length = task["max_length"]

    def best(fn):
        times, out = [], None
        for _ in range(1 + task["repeats"]):
            out = None  # release the previous output first
            start = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - start)
        return times, out

    ours_times, (res, form, plan_s) = best(lambda: pack_column(ds, max_length))
    trl_times, packed = best(lambda: pack_dataset(ds, max_length, strategy="bfd_split"))
    kept = int(pc.sum(pc.list_value_length(packed.data.column("input_ids"))).as_py())
    return {
        "documents": len(lengths),
        "tokens": int(offsets[-1]),
        "form": form,
        "ours_s": min(ours_times[1:]),
        "trl_s": min(trl_times[1:]),
        "ours_times": ours_times,
        "trl_times": trl_times,
        "ours_plan_s": plan_s,
        "ours_efficiency": float(res.efficiency),
        "trl_efficiency": kept / (len(packed) * max_length),
        "ours_lost": int(res.tokens_truncated + res.tokens_dropped),
        "trl_lost": int(offsets[-1]) - kept,
    }


CHILDREN = {"trl": child_trl, "ours": child_ours, "pack": child_pack}


# ------------------------------------------------------------------------------------------------ the parent


def _tree_memory(pid: int) -> tuple[int, int, int]:
    """``(sum of RSS, sum of anonymous RSS, largest anonymous RSS of one process)`` in bytes over ``pid`` and its
    descendants (Linux ``/proc``). Anonymous RSS leaves out the pages of memory-mapped files, which the kernel can
    drop and re-read at will."""
    import psutil

    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return 0, 0, 0
    rss = anon = largest_anon = 0
    for proc in procs:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            rss += int(fields["VmRSS"].split()[0]) * 1024
            own_anon = int(fields["RssAnon"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            continue
        anon += own_anon
        largest_anon = max(largest_anon, own_anon)
    return rss, anon, largest_anon


def run_child(kind: str, task: dict, env: dict[str, str], rss_limit: int, log: Path) -> dict:
    """Run one child in a fresh process; wall, peak RSS (largest process, exact) and polled tree peaks."""
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as out:
        result_path = out.name
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, json.dumps(task), result_path]
    start = time.perf_counter()
    with open(log, "a") as log_file:
        log_file.write(f"\n=== {kind} {json.dumps(task)}\n")
        log_file.flush()
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        peak_rss = peak_anon = peak_own_anon = 0
        killed = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            rss, anon, own_anon = _tree_memory(proc.pid)
            peak_rss, peak_anon, peak_own_anon = max(peak_rss, rss), max(peak_anon, anon), max(peak_own_anon, own_anon)
            if rss > rss_limit and not killed:
                killed = True
                os.killpg(proc.pid, 9)  # the child's own session: it and its workers, nothing else
            time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    result = {
        "wall_s": wall,
        "peak_rss": usage.ru_maxrss * 1024,
        "peak_anon": peak_own_anon,
        "tree_rss": peak_rss,
        "tree_anon": peak_anon,
        "ok": proc.returncode == 0 and not killed,
        "killed": killed,
    }
    try:
        with open(result_path) as f:
            result.update(json.load(f))
    except (OSError, ValueError):
        pass
    os.unlink(result_path)
    if not result["ok"]:
        result["error"] = f"killed above {rss_limit / GIB:.0f} GiB" if killed else f"exit {proc.returncode}, see {log}"
    return result


def child_env(ours_path: str | None, hf_cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "HF_DATASETS_CACHE": str(hf_cache),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
    )  # --ours-path may be someone else's checkout: write nothing there
    if ours_path:
        env["PYTHONPATH"] = os.pathsep.join([ours_path, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    return env


def side_runs(side: str, corpus: Path, args, scratch: Path, log: Path) -> list[dict]:
    """Cold then warm run of one side on one corpus; map caches and cache dirs cleared before and after."""
    clear_map_caches(corpus)
    cache_dir = scratch / f"{side}-cache"
    shutil.rmtree(cache_dir, ignore_errors=True)
    env = child_env(args.ours_path if side == "ours" else None, scratch / f"{side}-hf-datasets")
    task = {
        "corpus": str(corpus),
        "num_proc": args.num_proc,
        "max_length": args.max_length,
        "micro_batch_size": args.micro_batch_size,
        "cache_dir": str(cache_dir),
    }
    rows = []
    for run in ("cold", "warm"):
        result = run_child(side, task, env, int(args.rss_limit_gib * GIB), log)
        rows.append({"side": side, "run": run, **result})
        print(f"  {side:4} {run}: {_brief(result)}", flush=True)
        if not result["ok"]:
            break
    clear_map_caches(corpus)
    shutil.rmtree(cache_dir, ignore_errors=True)
    shutil.rmtree(scratch / f"{side}-hf-datasets", ignore_errors=True)
    return rows


def _brief(r: dict) -> str:
    if not r["ok"]:
        return f"FAILED ({r['error']}) after {r['wall_s']:.0f} s, peak RSS {r['peak_rss'] / GIB:.2f} GiB"
    return f"{r['wall_s']:.1f} s, peak RSS {r['peak_rss'] / GIB:.2f} GiB, tree {r['tree_rss'] / GIB:.2f} GiB"


def _gib(n) -> str:
    return f"{n / GIB:.2f}" if n else "-"


def _own(r: dict) -> tuple[float | None, int | None]:
    """``(wall, peak RSS)`` of the pipeline itself: less the child's library imports (time to import them, RSS
    once imported), which each side pays before it touches data."""
    if "import_rss" not in r:
        return None, None
    return r["wall_s"] - r["import_s"], r["peak_rss"] - r["import_rss"]


def print_runs(runs: list[dict]) -> None:
    print(
        "\n| docs | tokens | side | run | wall (s) | peak RSS (GiB) | peak anon RSS (GiB) | tree: RSS / anon (GiB) | "
        "imports: s / GiB | pipeline: s / GiB | tokens lost | token efficiency | tokenize / plan / first batch (s) |"
    )
    print("|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in runs:
        stages = r.get("stages", {})
        staged = " / ".join(f"{stages[k]:.1f}" for k in ("tokenize", "plan", "first_batch") if k in stages)
        if not r["ok"]:
            staged = f"FAILED: {r['error']}"
        lost = f"{r['tokens_lost']:,}" if "tokens_lost" in r else "-"
        eff = f"{r['token_efficiency']:.5f}" if "token_efficiency" in r else "-"
        tokens = f"{r['tokens'] / 1e6:.1f} M" if "tokens" in r else "-"
        own_s, own_rss = _own(r)
        imports = f"{r['import_s']:.1f} / {_gib(r['import_rss'])}" if "import_rss" in r else "-"
        own = f"{own_s:.1f} / {own_rss / GIB:.3f}" if own_s is not None else "-"
        print(
            f"| {r['docs']:,} | {tokens} | {r['side']} | {r['run']} | {r['wall_s']:.1f} | {_gib(r['peak_rss'])} | "
            f"{_gib(r.get('peak_anon'))} | {_gib(r['tree_rss'])} / {_gib(r['tree_anon'])} | {imports} | {own} | "
            f"{lost} | {eff} | {staged} |"
        )


def print_ratios(runs: list[dict]) -> None:
    pairs = {}
    for r in runs:
        if r["ok"]:
            pairs.setdefault((r["docs"], r["run"]), {})[r["side"]] = r
    rows = [(key, p) for key, p in pairs.items() if {"ours", "trl"} <= p.keys()]
    if not rows:
        return
    print(
        "\n| docs | run | wall ours / TRL | peak RSS ours / TRL | peak anon RSS ours / TRL | tree RSS ours / TRL | "
        "pipeline wall ours / TRL | pipeline peak RSS ours / TRL |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for (docs, run), p in rows:
        o, t = p["ours"], p["trl"]
        (o_s, o_rss), (t_s, t_rss) = _own(o), _own(t)
        own = f"{o_s / t_s:.2f}x | {o_rss / max(t_rss, 1):.2f}x" if o_s is not None and t_s is not None else "- | -"
        print(
            f"| {docs:,} | {run} | {o['wall_s'] / t['wall_s']:.2f}x | {o['peak_rss'] / t['peak_rss']:.2f}x | "
            f"{o['peak_anon'] / max(t['peak_anon'], 1):.2f}x | {o['tree_rss'] / max(t['tree_rss'], 1):.2f}x | {own} |"
        )


def rss_growth(runs: list[dict], key: str = "peak_rss") -> dict[str, float] | None:
    """Least-squares slope of ours' ``key`` (``peak_rss`` or ``peak_anon``, largest process) over tokens, per run
    kind (cold, warm): MiB per extra million tokens; ``None`` with fewer than two sizes."""
    out = {}
    for run in ("cold", "warm"):
        points = [(r["tokens"], r[key]) for r in runs if r["side"] == "ours" and r["run"] == run and r["ok"]]
        if len({tokens for tokens, _ in points}) >= 2:
            tokens, rss = np.array(points, dtype=np.float64).T
            out[run] = float(np.polyfit(tokens / 1e6, rss / 2**20, 1)[0])
    return out or None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="documents per corpus (150000 300000)")
    parser.add_argument("--num-proc", type=int, default=min(4, os.cpu_count() or 1), help="map workers, both sides")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--skip-trl", action="store_true", help="ours only")
    parser.add_argument("--skip-pack", action="store_true", help="no pack_sequences vs pack_dataset figure")
    parser.add_argument("--quick", action="store_true", help="5 k documents, a smaller packing figure (smoke test)")
    parser.add_argument("--big", action="store_true", help="2.5 M documents (~1 B tokens), ours only")
    parser.add_argument(
        "--pretokenized",
        action="store_true",
        help="corpora of input_ids (what the tokenizer would make): both sides skip tokenization",
    )
    parser.add_argument("--ours-path", default=str(REPO), help="checkout put first on PYTHONPATH for ours")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="where corpora are written")
    parser.add_argument("--pack-documents", type=int, default=None, help="documents in the packing figure (200 k)")
    parser.add_argument("--histogram", default="wikipedia-512.tsv", help="length histogram for the packing figure")
    parser.add_argument("--rss-limit-gib", type=float, default=12.0, help="kill a child tree above this RSS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pack-only", action="store_true", help="only the pack_sequences vs pack_dataset figure")
    args = parser.parse_args(argv)
    sizes = (
        []
        if args.pack_only
        else args.sizes or ([2_500_000] if args.big else [5_000] if args.quick else [150_000, 300_000])
    )
    skip_trl = args.skip_trl or args.big

    scratch = Path(tempfile.mkdtemp(prefix="seqmem-scale-"))
    log = scratch / "children.log"
    print(
        f"# scale benchmark: sizes {sizes}, num_proc {args.num_proc}, max_length {args.max_length}, "
        f"ours from {args.ours_path}; child logs in {log}",
        flush=True,
    )
    runs: list[dict] = []
    try:
        for n_docs in sizes:
            start = time.perf_counter()
            corpus = write_corpus(n_docs, args.data_dir, args.seed, pretokenized=args.pretokenized)
            meta = json.loads((corpus / "meta.json").read_text())
            print(
                f"{n_docs:,} documents, {meta['words'] / 1e6:.1f} M words ({corpus}, "
                f"{time.perf_counter() - start:.0f} s)",
                flush=True,
            )
            for side in ("ours",) if skip_trl else ("trl", "ours"):
                runs += [{"docs": n_docs, **r} for r in side_runs(side, corpus, args, scratch, log)]
        pack = None
        if not args.skip_pack and not args.big:
            task = {
                "documents": args.pack_documents or (10_000 if args.quick else 200_000),
                "seed": args.seed,
                "histogram": args.histogram,
                "max_length": int(args.histogram.rsplit("-", 1)[1].split(".")[0]),
                "repeats": 1 if args.quick else 3,
            }
            pack = run_child(
                "pack", task, child_env(args.ours_path, scratch / "pack-hf"), int(args.rss_limit_gib * GIB), log
            )
    finally:
        report_log = log.read_text() if log.exists() else ""
        shutil.rmtree(scratch, ignore_errors=True)

    print_runs(runs)
    print_ratios(runs)
    for key, what in (("peak_rss", "peak RSS"), ("peak_anon", "peak anonymous RSS")):
        growth = rss_growth(runs, key)
        if growth:
            print(
                f"\nGrowth of ours' {what} (largest process, least squares over the sizes), MiB per extra million "
                "tokens: " + ", ".join(f"{run} {mib:.2f}" for run, mib in growth.items())
            )
    if pack is not None:
        if pack["ok"]:
            print(
                f"\n| packing, {pack['documents']:,} documents from {args.histogram} ({pack['tokens'] / 1e6:.1f} M "
                "tokens) | time (s) | efficiency | tokens lost |\n|---|---:|---:|---:|"
            )
            print(
                f"| ours `{pack['form']}` | {pack['ours_s']:.3f} | "
                f"{pack['ours_efficiency']:.5f} | {pack['ours_lost']:,} |"
            )
            print(
                f"| TRL `pack_dataset(ds, strategy='bfd_split')` | {pack['trl_s']:.3f} | {pack['trl_efficiency']:.5f} "
                f"| {pack['trl_lost']:,} |"
            )
            calls = {side: ", ".join(f"{t:.3f}" for t in pack[f"{side}_times"]) for side in ("ours", "trl")}
            print(
                f"\nours is {pack['trl_s'] / pack['ours_s']:.1f}x TRL's speed on the same Dataset (best of "
                f"{len(pack['ours_times']) - 1} after a warm-up; every call, warm-up first, ours: {calls['ours']} s, "
                f"TRL: {calls['trl']} s; ours' last plan took {pack['ours_plan_s']:.3f} s)."
            )
        else:
            print(f"\npacking figure FAILED: {pack['error']}")
    if any(not r["ok"] for r in runs) or (pack is not None and not pack["ok"]):
        print("\nlast lines of the child logs:\n" + "\n".join(report_log.splitlines()[-30:]))


def _child_main(kind: str, task_json: str, result_path: str) -> None:
    result = CHILDREN[kind](json.loads(task_json))
    result["done_s"] = time.perf_counter() - T_START  # the rest of the wall is interpreter start-up and exit
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        _child_main(*sys.argv[2:])
    else:
        main()
