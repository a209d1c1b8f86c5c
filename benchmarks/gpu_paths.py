"""The GPU paths no CPU test reaches (issue 45), as sections of ``benchmarks/gpu.py`` (``--sections paths``).

- varlen: a training step through the ``torch_varlen`` flash path under bf16-mixed (packed rows), its loss against
  SDPA's on the same batch; a few optimizer steps, finite gradients.
- OOM: a real CUDA out-of-memory error forced in the backward (the allocator's limit set between the step's forward
  peak and its backward peak: ``torch.cuda.set_per_process_memory_fraction``), ``on_oom="split"``: the gradient
  against the unsplit step's, and ``memory_allocated`` after the step against the unsplit run's.
- FSDP buffers: ``FSDPStrategy`` (world size 1) under bf16-mixed, the dtype of Llama's rotary ``inv_freq``.
- QLoRA: a 4-bit base (bitsandbytes) with a LoRA adapter and gradient checkpointing, a few optimizer steps.

Without CUDA (``--smoke`` on a CPU) each section runs a stand-in where one exists, with the reason printed: SDPA for
the varlen kernel, :class:`~lightning_seqmem.oom.split.OomInjector` in the backward for the allocator's limit, FSDP
on a gloo rank, LoRA without the 4-bit base. Their figures check the script, not the GPU.
"""

from __future__ import annotations

import os
import sys
import tempfile

from gpu_memory import TINY_MODEL

VOCAB = 32_000
FULL = dict(
    model=dict(
        model_type="llama",
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    ),
    vocab=VOCAB,
    varlen_shape=(4, 2048),
    oom_shape=(8, 1024),
)
SMOKE = dict(
    model=TINY_MODEL,  # the memory sections' CPU stand-in, one definition
    vocab=512,
    varlen_shape=(2, 128),
    oom_shape=(4, 64),
)


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def trainer(steps: int, precision: str, callbacks=(), **kwargs):
    import lightning.pytorch as L

    return L.Trainer(
        max_steps=steps,
        accelerator="cuda" if cuda() else "cpu",
        devices=1,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=list(callbacks),
        **kwargs,
    )


def batches(shape: tuple[int, int], vocab: int, packed: bool, n: int = 2):
    from lightning_seqmem.memory.worst_batch import make_dummy_batch

    keys = ("input_ids", "labels", "position_ids") if packed else ("input_ids", "labels", "attention_mask")
    return [make_dummy_batch(*shape, keys, vocab, seed=seed) for seed in range(n)]


def grads_callback():
    """Records the gradients the optimizer steps on (each step's, by step), and memory_allocated after each step."""
    import lightning.pytorch as L
    import torch

    class Grads(L.Callback):
        def __init__(self):
            self.grads, self.allocated = {}, {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.grads[trainer.global_step] = {
                n: p.grad.detach().to("cpu", torch.float32, copy=True)
                for n, p in pl_module.named_parameters()
                if p.grad is not None
            }

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                self.allocated[trainer.global_step] = torch.cuda.memory_allocated()

    return Grads()


def relative(a: dict, b: dict) -> float:
    import torch

    diff = torch.cat([(a[n] - b[n]).flatten() for n in b]).norm()
    return float(diff / torch.cat([t.flatten() for t in b.values()]).norm())


def model(size: dict, length: int, **kwargs):
    import torch

    from lightning_seqmem import CausalLM

    torch.manual_seed(0)
    config = dict(size["model"], max_position_embeddings=max(length, size["model"]["max_position_embeddings"]))
    return CausalLM(model_config=config, vocab_size=size["vocab"], pad_token_id=0, **kwargs)


# ------------------------------------------------------------------------------------------------ sections
def child_varlen(size: dict) -> dict:
    from torch.utils.data import DataLoader

    attn = "torch_varlen" if cuda() else "sdpa"
    data = batches(size["varlen_shape"], size["vocab"], packed=True, n=3)
    losses = {}
    for name in (attn, "sdpa"):
        m = model(size, size["varlen_shape"][1], attn_implementation=name, cross_entropy="chunked")
        callback = grads_callback()
        t = trainer(3, "bf16-mixed", [callback])
        t.fit(m, DataLoader(data, batch_size=None))
        finite = all(bool(g.isfinite().all()) for step in callback.grads.values() for g in step.values())
        losses[name] = dict(loss=float(t.callback_metrics["train/loss"]), finite=finite, steps=t.global_step)
    return dict(
        attn=attn,
        loss=losses[attn]["loss"],
        sdpa_loss=losses["sdpa"]["loss"],
        finite=losses[attn]["finite"],
        steps=losses[attn]["steps"],
        skipped=None if cuda() else "torch_varlen needs CUDA with bf16/fp16 (ran SDPA as the stand-in)",
    )


def peaks_callback():
    """At the second step (CUDA): ``memory_allocated`` before it, the peak at the end of its forward (just before
    the backward) and the step's peak: where to set a limit that the forward fits under and the backward does not."""
    import lightning.pytorch as L
    import torch

    class Peaks(L.Callback):
        def __init__(self):
            self.base = self.forward = self.step = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1 and torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                self.base = torch.cuda.memory_allocated()

        def on_before_backward(self, trainer, pl_module, loss):
            if self.base is not None and self.forward is None:
                self.forward = torch.cuda.max_memory_allocated()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if self.forward is not None and self.step is None:
                self.step = torch.cuda.max_memory_allocated()

    return Peaks()


def limit_memory(limit: int | None, tokens: int):
    """From the second step on, the allocator may reserve no more than ``limit`` bytes (CUDA: a real out-of-memory
    error); without CUDA an ``OomInjector`` in the backward above half the batch stands in."""
    import lightning.pytorch as L
    import torch

    from lightning_seqmem.oom.split import OomInjector

    class Limit(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx != 1:
                return
            if limit is None:
                OomInjector(tokens // 2, where="backward").install(pl_module.model.model.layers[0])
                return
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.get_device_properties(0).total_memory)

    return Limit()


def child_oom(size: dict) -> dict:
    import torch
    from torch.utils.data import DataLoader

    rows, length = size["oom_shape"]
    data = batches((rows, length), size["vocab"], packed=False, n=2)
    peaks, limit, runs = peaks_callback(), None, {}
    for on_oom in ("raise", "split"):
        m = model(size, length, cross_entropy="full", on_oom=on_oom)
        callback = grads_callback()
        if on_oom == "raise":
            callbacks = [callback, peaks]
        else:
            if cuda():  # the forward fits, the whole step's backward does not, a half's does
                limit = (peaks.forward + peaks.step) // 2
            callbacks = [callback, limit_memory(limit, rows * length)]
        t = trainer(2, "32-true", callbacks)
        t.fit(m, DataLoader(data, batch_size=None))
        if cuda():
            torch.cuda.set_per_process_memory_fraction(1.0)
        runs[on_oom] = dict(grads=callback.grads[1], allocated=callback.allocated.get(2), events=m.oom_events)
    events = runs["split"]["events"]
    return dict(
        splits=len(events),
        phases=sorted({e["phase"] for e in events}),
        torch_said=events[0]["error"][:120] if events else "",
        grad_relative=relative(runs["split"]["grads"], runs["raise"]["grads"]),
        allocated_split=runs["split"]["allocated"],
        allocated_raise=runs["raise"]["allocated"],
        peaks=None if limit is None else [peaks.base, peaks.forward, peaks.step],
        limit=limit,
        skipped=None if cuda() else "a real CUDA OOM needs the CUDA allocator (OomInjector in the backward instead)",
    )


def child_fsdp_buffers(size: dict) -> dict:
    import torch
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.utils.data import DataLoader

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if cuda():
        strategy = FSDPStrategy()
    else:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        from _memory_cpu_fsdp import CPUFSDPStrategy

        strategy = CPUFSDPStrategy(process_group_backend="gloo")
    m = model(size, 64)
    t = trainer(1, "bf16-mixed", strategy=strategy)
    t.fit(m, DataLoader(batches((2, 64), size["vocab"], packed=True, n=1), batch_size=None))
    buffer = m.model.model.rotary_emb.inv_freq
    return dict(dtype=str(buffer.dtype).replace("torch.", ""), finite=bool(torch.isfinite(buffer).all()))


def child_qlora(size: dict) -> dict:
    import importlib.util

    from torch.utils.data import DataLoader

    from lightning_seqmem.training.building import build_causal_lm

    missing = [name for name in ("peft", "bitsandbytes") if importlib.util.find_spec(name) is None]
    quantize = "nf4" if cuda() and not missing else None
    skipped = None
    if quantize is None:
        skipped = f"QLoRA needs CUDA and bitsandbytes ({'no CUDA' if not cuda() else 'missing: ' + ', '.join(missing)})"
        if importlib.util.find_spec("peft") is None:
            return dict(skipped=skipped + "; peft missing: no stand-in", loss=None, finite=False, steps=0)
        skipped += " (LoRA on a full-precision base as the stand-in)"
    with tempfile.TemporaryDirectory() as path:
        build_causal_lm(dict(size["model"]), None, size["vocab"], 0, "sdpa").save_pretrained(path)
        m = model(size, 128, pretrained_path=path, lora=dict(r=8, quantize=quantize), gradient_checkpointing=True)
        callback = grads_callback()
        t = trainer(3, "bf16-mixed", [callback])
        t.fit(m, DataLoader(batches((2, 128), size["vocab"], packed=True, n=3), batch_size=None))
    finite = all(bool(g.isfinite().all()) for step in callback.grads.values() for g in step.values())
    trained = sum(len(step) for step in callback.grads.values())
    return dict(
        loss=float(t.callback_metrics["train/loss"]),
        finite=finite and trained > 0,
        steps=t.global_step,
        skipped=skipped,
    )


CHECKS = ("varlen", "OOM", "FSDP buffers", "QLoRA")
CHILDREN = {
    "varlen": child_varlen,
    "oom": child_oom,
    "fsdp_buffers": child_fsdp_buffers,
    "qlora": child_qlora,
}


def sizes(smoke: bool) -> dict:
    return SMOKE if smoke else FULL


# ----------------------------------------------------------------------------------------------- the rows
def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f} MiB"


def rows(smoke: bool, run_child) -> list[tuple[str, str, str, str, bool]]:
    """(check, case, measured, target, ok) for each section; a skipped part says why in its row."""
    out = []
    v = run_child(smoke, "varlen")
    if "error" in v:
        out.append(("varlen", "torch_varlen, bf16-mixed", v["error"], "runs", False))
    else:
        diff = abs(v["loss"] - v["sdpa_loss"])
        note = f" [{v['skipped']}]" if v["skipped"] else ""
        out.append(
            (
                "varlen",
                f"{v['attn']}, bf16-mixed, packed rows, {v['steps']} steps",
                f"loss {v['loss']:.4f} vs SDPA {v['sdpa_loss']:.4f} (diff {diff:.1e}), gradients finite "
                f"{v['finite']}{note}",
                "diff <= 2e-2, finite",
                diff <= 2e-2 and v["finite"] and v["steps"] == 3,
            )
        )
    o = run_child(smoke, "oom")
    if "error" in o:
        out.append(("OOM", "real CUDA OOM in backward, on_oom='split'", o["error"], "runs", False))
    else:
        split, unsplit = o["allocated_split"], o["allocated_raise"]
        same = split == unsplit or (None not in (split, unsplit) and abs(split - unsplit) <= 2**20)
        limit = "" if o["limit"] is None else f", limit {_mib(o['limit'])} (peaks {', '.join(map(_mib, o['peaks']))})"
        note = f" [{o['skipped']}]" if o["skipped"] else ""
        out.append(
            (
                "OOM",
                "forced in the backward, on_oom='split' vs unsplit",
                f"{o['splits']} split(s) in {'/'.join(o['phases']) or '-'}, gradient relative {o['grad_relative']:.1e}, "
                f"allocated after {_mib(split)} vs {_mib(unsplit)}"
                f"{'' if None in (split, unsplit) else f' (diff {split - unsplit} B)'}{limit}; torch: "
                f"{o['torch_said']}{note}",
                "backward, gradient <= 1e-4, allocated within 1 MiB",
                o["splits"] >= 1 and "backward" in o["phases"] and o["grad_relative"] <= 1e-4 and same,
            )
        )
    f = run_child(smoke, "fsdp_buffers")
    if "error" in f:
        out.append(("FSDP buffers", "bf16-mixed, world size 1", f["error"], "runs", False))
    else:
        out.append(
            ("FSDP buffers", "bf16-mixed, world size 1", f"inv_freq {f['dtype']}", "float32", f["dtype"] == "float32")
        )
    q = run_child(smoke, "qlora")
    if "error" in q:
        out.append(("QLoRA", "nf4 + LoRA + checkpointing", q["error"], "runs", False))
    else:
        note = f" [{q['skipped']}]" if q["skipped"] else ""
        loss = "n/a" if q["loss"] is None else f"{q['loss']:.4f}"
        ok = q["steps"] == 3 and q["finite"] or (q["loss"] is None and smoke)
        out.append(("QLoRA", "nf4 + LoRA + checkpointing, 3 steps", f"loss {loss}{note}", "trains, finite", ok))
    return out
