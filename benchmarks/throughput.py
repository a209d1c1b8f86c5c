"""Throughput benchmarks.

Strategies (no ``--device``): the tiny model trained on the same data with ``pad``, ``truncate`` and ``pack``.
Per strategy: real tokens/s, slots/s (real + padding), token efficiency and peak memory (RSS on CPU, allocated
on CUDA). Each strategy runs in a fresh subprocess so peak memory is its own. The target for ``pack``: real-token
throughput >= 0.9 x what removing the padding allows, i.e. ``pad real tok/s x (pad slots / pack slots)`` per real
token, which is ``pad slots/s`` when both run at the same slots/s.

    python benchmarks/throughput.py                  # 30 timed steps per strategy, max_length 256, 8 rows
    python benchmarks/throughput.py --steps 10 --max-length 128

Loops (``--device cpu|cuda``): the SAME packed batches (``SeqMemDataModule(strategy="pack")``, materialised once)
through a bare PyTorch loop (forward, backward, AdamW foreach), the bare loop without ``position_ids`` (one causal
sequence per row: the attention bound), and ``CausalLM`` + ``Trainer`` (gradient clipping 1.0, token-weighted loss,
no logger or progress bar) per attention implementation, and TRL's SFTTrainer on the same documents, tokenizer and
model config (packed and padded; ``pip install -e ".[bench]"``); on CUDA also compiled loops. Real (label-bearing) tokens per second over the timed steps (per second of
wall-clock on CUDA, of process CPU time with one thread on CPU); each loop in a fresh subprocess, loops interleaved over
``--repeats`` rounds, the median reported. On CUDA: the 123.5 M Llama of issue 18
(hidden 768, 12 layers, 12 heads / 3 key-value heads, MLP 2048, vocabulary 32,000), bf16-mixed, rows of 2,048,
micro-batch 8; on CPU: ``tiny_llama``, fp32.

    python benchmarks/throughput.py --device cpu     # bare loop vs CausalLM, tiny model
    python benchmarks/throughput.py --device cuda    # the full table (benchmarks/gpu.py can call loop_table())
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# --------------------------------------------------------------------------------------------------------- loops
LLAMA_123M = dict(
    model_type="llama",
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=3,
    max_position_embeddings=4096,
    vocab_size=32000,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
)


def _setup(args: argparse.Namespace):
    """The shared pieces of every loop: device, model config, precision, and the packed batches (CPU tensors)."""
    import torch

    from lightning_seqmem import SeqMemDataModule
    from lightning_seqmem.batch import count_label_tokens

    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(1)  # no OpenMP spin-waiting: CPU time then counts work only, whatever else runs
    dm = SeqMemDataModule(max_length=args.max_length, micro_batch_size=args.rows, strategy="pack", seed=0)
    dm.setup("fit")
    batches, needed = [], args.warmup + args.steps
    while len(batches) < needed:
        batches.extend(b for _, b in zip(range(needed - len(batches)), dm.train_dataloader()))
    cuda = args.device == "cuda"
    config = dict(LLAMA_123M) if args.model == "123m" else {"preset": "tiny_llama"}
    vocab = max(config.get("vocab_size", 0), len(dm.tokenizer))
    real = sum(int(count_label_tokens(b)) for b in batches[args.warmup :])
    return torch.device(args.device), config, vocab, dm.pad_token_id, batches, real, cuda


def _model_config(config: dict):
    return config["preset"] if "preset" in config else {k: v for k, v in config.items() if k != "vocab_size"}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _clock(device):
    """Wall-clock on CUDA; on CPU this process's CPU time, since a shared CPU's wall-clock varies many-fold with other
    load (the loops' overhead is CPU work there, which CPU time counts)."""
    return time.perf_counter if device.type == "cuda" else time.process_time


def _bare(args: argparse.Namespace, drop_positions=False, compiled=False, attn="sdpa") -> dict:
    """A bare loop: no Lightning, HF's mean loss, AdamW foreach."""
    import torch

    from lightning_seqmem import CausalLM

    device, config, vocab, pad, batches, real, cuda = _setup(args)
    model = (
        CausalLM(model_config=_model_config(config), vocab_size=vocab, pad_token_id=pad, attn_implementation=attn)
        .model.to(device)
        .train()
    )
    if compiled:
        model.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    dtype = torch.bfloat16 if cuda else None
    start = 0.0
    for step, batch in enumerate(batches):
        if step == args.warmup:
            _sync(device)
            start = _clock(device)()
        batch = {
            k: v.to(device, non_blocking=True) for k, v in batch.items() if not (drop_positions and k == "position_ids")
        }
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = model(**batch, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _sync(device)
    return {"real_tok_s": real / (_clock(device)() - start)}


def _ours(args: argparse.Namespace, attn="sdpa", clip=1.0, compiled=False, loss="token") -> dict:
    """CausalLM + Trainer on the same batches, timed from the first timed step's start to the end of training."""
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from lightning_seqmem import CausalLM

    device, config, vocab, pad, batches, real, cuda = _setup(args)
    clock = {}

    class Clock(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == args.warmup:
                _sync(device)
                clock["start"] = _clock(device)()

        def on_train_end(self, trainer, pl_module):
            _sync(device)
            clock["end"] = _clock(device)()

    extra = {"compile": True} if compiled else {}  # (runs against older code too: --loops NAME@DIR)
    model = CausalLM(
        model_config=_model_config(config),
        vocab_size=vocab,
        pad_token_id=pad,
        attn_implementation=attn,
        loss_normalization=loss,
        **extra,
    )
    trainer = L.Trainer(
        accelerator=device.type,
        devices=1,
        precision="bf16-mixed" if cuda else "32-true",
        max_steps=len(batches),
        gradient_clip_val=clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[Clock()],
    )
    trainer.fit(model, train_dataloaders=DataLoader(batches, batch_size=None))
    return {"real_tok_s": real / (clock["end"] - clock["start"]), "attn": model.model.config._attn_implementation}


def _trl(args: argparse.Namespace, packing: bool = True) -> dict:
    """TRL's SFTTrainer on the same documents, tokenizer and model config: ``packing=True`` (its best-fit packing,
    padding-free batches of ``rows`` packed sequences) or padded batches of ``rows`` documents. Real (label) tokens
    are counted on the batches TRL builds, on the device (no host sync per step)."""
    import tempfile

    import torch
    from trl import SFTConfig, SFTTrainer

    from lightning_seqmem import CausalLM, SeqMemDataModule
    from lightning_seqmem.batch import count_label_tokens
    from lightning_seqmem.data.sources import load_text_dataset

    device, config, vocab, pad, _, _, cuda = _setup(args)
    tokenizer = SeqMemDataModule(max_length=args.max_length).tokenizer
    documents = load_text_dataset("builtin")["train"]
    model = CausalLM(
        model_config=_model_config(config), vocab_size=vocab, pad_token_id=pad, attn_implementation="sdpa"
    ).model
    clock: dict = {"steps": 0, "real": torch.zeros((), dtype=torch.long, device=device)}

    class Timed(SFTTrainer):
        def training_step(self, model, inputs, *rest, **kwargs):
            if clock["steps"] == args.warmup:
                _sync(device)
                clock["start"] = _clock(device)()
            if clock["steps"] >= args.warmup:
                clock["real"] += count_label_tokens(inputs)
            clock["steps"] += 1
            return super().training_step(model, inputs, *rest, **kwargs)

    with tempfile.TemporaryDirectory() as out:
        cfg = SFTConfig(
            output_dir=out,
            max_length=args.max_length,
            packing=packing,
            per_device_train_batch_size=args.rows,
            max_steps=args.warmup + args.steps,
            learning_rate=1e-4,
            lr_scheduler_type="constant",
            max_grad_norm=1.0,
            bf16=cuda,
            use_cpu=not cuda,
            gradient_checkpointing=False,
            logging_strategy="no",
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
        )
        trainer = Timed(model=model, args=cfg, train_dataset=documents, processing_class=tokenizer)
        trainer.train()
        _sync(device)
        end = _clock(device)()
    return {"real_tok_s": int(clock["real"]) / (end - clock["start"])}


# name: (what, CUDA only, the loop, its arguments)
LOOPS = {
    "bare": ("bare PyTorch loop (forward, backward, AdamW foreach), SDPA, packed rows", False, _bare, {}),
    "bound": (
        "the same, position_ids dropped (one causal sequence per row: the attention bound)",
        False,
        _bare,
        dict(drop_positions=True),
    ),
    "bare_compiled": ("the same packed loop under torch.compile", True, _bare, dict(compiled=True)),
    "bare_flex": ("bare loop, flex_attention", True, _bare, dict(attn="flex_attention")),
    "ours_sdpa": ("CausalLM + Trainer, SDPA (clip 1.0, token-weighted loss)", False, _ours, {}),
    "ours_torch_varlen": (
        "CausalLM + Trainer, torch_varlen (clip 1.0, token-weighted loss)",
        True,
        _ours,
        dict(attn="torch_varlen"),
    ),
    "ours_auto": ("CausalLM + Trainer, attn_implementation='auto'", True, _ours, dict(attn="auto")),
    "ours_sdpa_noclip": ("CausalLM + Trainer, SDPA, clipping off", False, _ours, dict(clip=None)),
    "ours_sdpa_micro": (
        "CausalLM + Trainer, SDPA, clipping off, loss_normalization='micro_batch'",
        False,
        _ours,
        dict(clip=None, loss="micro_batch"),
    ),
    "ours_compiled": ("CausalLM(compile=True) + Trainer, SDPA", True, _ours, dict(compiled=True)),
    "ours_varlen_compiled": (
        "CausalLM(compile=True) + Trainer, torch_varlen",
        True,
        _ours,
        dict(attn="torch_varlen", compiled=True),
    ),
    "trl_packed": ("TRL SFTTrainer, packing=True (best-fit, padding-free), SDPA, same documents", False, _trl, {}),
    "trl_padded": ("TRL SFTTrainer, padded batches, SDPA, same documents", False, _trl, dict(packing=False)),
}


def run_loop(name: str, args: argparse.Namespace) -> dict:
    """One loop of :data:`LOOPS`, in this process."""
    _, _, loop, kwargs = LOOPS[name]
    return loop(args, **kwargs)


def loop_settings(
    device: str,
    steps: int | None = None,
    warmup: int | None = None,
    max_length: int | None = None,
    model: str | None = None,
    repeats: int | None = None,
) -> dict:
    """The loops' settings with this device's defaults filled in (CUDA: issue 18's model and rows of 2,048)."""
    cuda = device == "cuda"
    return {
        "steps": steps or 25,
        "warmup": 5 if warmup is None else warmup,
        "max_length": max_length or (2048 if cuda else 256),
        "model": model or ("123m" if cuda else "tiny"),
        "repeats": repeats or (1 if cuda else 3),
    }


def loop_table(
    device: str = "cuda",
    loops: list[str] | None = None,
    steps: int | None = None,
    warmup: int | None = None,
    max_length: int | None = None,
    rows: int = 8,
    model: str | None = None,
    repeats: int | None = None,
) -> list[dict]:
    """Run the loops (each in a fresh subprocess, interleaved over ``repeats`` rounds) and return one dict per loop:
    ``loop``, ``what``, ``real_tok_s`` (median), ``runs``, ``vs_bare``, ``vs_bound`` (or ``error``). Unset settings
    take :func:`loop_settings`' defaults. Importable by other benchmark scripts (``benchmarks/gpu.py``)."""
    cuda = device == "cuda"
    settings = loop_settings(device, steps, warmup, max_length, model, repeats)
    steps, warmup, max_length, model, repeats = (
        settings[k] for k in ("steps", "warmup", "max_length", "model", "repeats")
    )
    loops = loops or [n for n, (_, cuda_only, _, _) in LOOPS.items() if cuda or not cuda_only]
    runs: dict[str, list[dict]] = {name: [] for name in loops}
    for _ in range(repeats):
        for name in loops:
            loop, _, tree = name.partition("@")  # NAME@DIR: the same loop with the package found in DIR first
            cmd = [
                sys.executable,
                __file__,
                "--loop-worker",
                loop,
                "--device",
                device,
                "--steps",
                str(steps),
                "--warmup",
                str(warmup),
                "--max-length",
                str(max_length),
                "--rows",
                str(rows),
                "--model",
                model,
            ]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")]))}
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            lines = done.stdout.strip().splitlines()
            if done.returncode != 0 or not lines:
                runs[name].append({"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:160]})
            else:
                runs[name].append(json.loads(lines[-1]))
    table = []
    for name in loops:
        ok = [r["real_tok_s"] for r in runs[name] if "real_tok_s" in r]
        loop, _, tree = name.partition("@")
        row = {"loop": name, "what": LOOPS[loop][0] + (f" [code in {tree}]" if tree else ""), "runs": ok}
        if ok:
            row["real_tok_s"] = statistics.median(ok)
            row["attn"] = next((r["attn"] for r in runs[name] if "attn" in r), None)
        else:
            row["error"] = runs[name][-1].get("error", "?")
        table.append(row)
    by_name = {r["loop"]: r.get("real_tok_s") for r in table}
    for row in table:
        for ref in ("bare", "bound"):
            if row.get("real_tok_s") and by_name.get(ref):
                row[f"vs_{ref}"] = row["real_tok_s"] / by_name[ref]
    return table


def print_loop_table(table: list[dict], header: str) -> None:
    print(header)
    print("| loop | real tokens/s | vs bare loop | vs no-mask bound | runs |")
    print("|---|---:|---:|---:|---|")
    for row in table:
        if "real_tok_s" not in row:
            print(f"| {row['what']} | error: {row.get('error', '?')} | | | |")
            continue
        runs = ", ".join(f"{r:,.0f}" for r in row["runs"])
        what = row["what"] + (f" (ran {row['attn']})" if row["loop"].startswith("ours_auto") else "")
        print(
            f"| {what} | {row['real_tok_s']:,.0f} | {row.get('vs_bare', float('nan')):.3f} | "
            f"{row.get('vs_bound', float('nan')):.3f} | {runs} |"
        )


# ---------------------------------------------------------------------------------------------------- strategies


def worker(strategy: str, steps: int, max_length: int, rows: int, warmup: int) -> dict:
    import torch

    from lightning_seqmem import CausalLM, SeqMemDataModule
    from lightning_seqmem.apps.summary import peak_memory_bytes
    from lightning_seqmem.batch import count_real_tokens

    torch.manual_seed(0)
    dm = SeqMemDataModule(max_length=max_length, micro_batch_size=rows, strategy=strategy, seed=0)
    dm.setup("fit")
    model = CausalLM(vocab_size=len(dm.tokenizer), pad_token_id=dm.pad_token_id)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    real = slots = 0
    elapsed = 0.0
    loader = iter(dm.train_dataloader())
    for step in range(warmup + steps):
        batch = {k: v.to(device) for k, v in next(loader).items()}
        start = time.perf_counter()
        loss = model(batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= warmup:
            elapsed += time.perf_counter() - start
            real += int(count_real_tokens(batch, dm.pad_token_id))
            slots += batch["input_ids"].numel()
    peak, _ = peak_memory_bytes(device)
    return {
        "strategy": strategy,
        "real_tok_s": real / elapsed,
        "slots_s": slots / elapsed,
        "efficiency": real / slots,
        "peak_mib": peak / 2**20,
        "lost": dm.stats()["train"]["tokens_truncated"] + dm.stats()["train"]["tokens_dropped"],
        "device": device.type,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps (strategies 30, loops 25)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed first steps (strategies 3, loops 5)")
    parser.add_argument("--max-length", type=int, default=None, help="row length (256; loops on CUDA 2048)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="run the loops table on this device")
    parser.add_argument(
        "--loops",
        default=None,
        help=f"comma-separated subset of {', '.join(LOOPS)}; NAME@DIR "
        "runs a loop with the lightning_seqmem package in DIR (e.g. an older commit's, git archive)",
    )
    parser.add_argument("--model", choices=("tiny", "123m"), default=None, help="loops: tiny_llama or issue 18's")
    parser.add_argument("--repeats", type=int, default=None, help="loops: interleaved rounds (CPU 3, CUDA 1)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--loop-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loop_worker:
        print(json.dumps(run_loop(args.loop_worker, args)))
        return
    if args.device:
        s = loop_settings(args.device, args.steps, args.warmup, args.max_length, args.model, args.repeats)
        table = loop_table(args.device, args.loops.split(",") if args.loops else None, rows=args.rows, **s)
        import torch

        machine = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (1 thread, process CPU time)"
        print_loop_table(
            table,
            f"{machine}, torch {torch.__version__}, model {s['model']}, packed rows of "
            f"{s['max_length']}, micro-batch {args.rows}, {s['steps']} timed steps after "
            f"{s['warmup']}, median of {s['repeats']}",
        )
        return
    args.steps, args.warmup = args.steps or 30, args.warmup if args.warmup is not None else 3
    args.max_length = args.max_length or 256
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.max_length, args.rows, args.warmup)))
        return
    results = {}
    for strategy in ("pad", "truncate", "pack"):
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            strategy,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--max-length",
            str(args.max_length),
            "--rows",
            str(args.rows),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results[strategy] = json.loads(out.strip().splitlines()[-1])
    print(
        f"max_length={args.max_length}, rows={args.rows}, {args.steps} timed steps, device={results['pad']['device']}"
    )
    print("| strategy | real tokens/s | slots/s | token efficiency | tokens lost (train) | peak memory (MiB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results.values():
        print(
            f"| {r['strategy']} | {r['real_tok_s']:,.0f} | {r['slots_s']:,.0f} | {r['efficiency']:.3f} | "
            f"{r['lost']:,} | {r['peak_mib']:,.0f} |"
        )
    pad, pack = results["pad"], results["pack"]
    # Removing the padding turns every padded slot into a real one at the same per-slot cost.
    allowed = pad["real_tok_s"] / pad["efficiency"] * pack["efficiency"]
    print(
        f"\npack real tokens/s = {pack['real_tok_s']:,.0f}; padding-free bound from pad = {allowed:,.0f}; "
        f"ratio {pack['real_tok_s'] / allowed:.2f} (target >= 0.9)"
    )


if __name__ == "__main__":
    main()
