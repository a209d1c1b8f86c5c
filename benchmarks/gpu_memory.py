"""The memory sections of ``benchmarks/gpu.py``: pre-allocation, planner, contamination, FSDP (their children).

Each child runs in a fresh process started by ``gpu.py`` (its own allocator settings and statistics) and returns a
JSON-able result; ``gpu.py`` turns the results into the table's rows.
"""

from __future__ import annotations

import math
import os
import sys
import time

VOCAB = 32_000
MAIN_MODEL = dict(
    model_type="llama",
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=4096,
)
TINY_MODEL = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
PLANNER_SIZES = [  # hidden, layers, heads, kv heads, intermediate
    (128, 2, 4, 2, 512),
    (256, 4, 4, 2, 704),
    (384, 6, 6, 2, 1024),
    (512, 8, 8, 4, 1408),
    (640, 10, 10, 5, 1728),
    (768, 12, 12, 4, 2048),
    (1024, 12, 16, 8, 2816),
    (1024, 20, 16, 8, 2816),
    (1280, 16, 20, 4, 3456),
]
PREALLOC_RUNS = [  # name, strategy, pre-allocation, expandable segments, rows never padded
    ("pad, nothing", "pad", False, False, False),
    ("pad, CachePreallocator", "pad", True, False, False),
    ("pad, CachePreallocator + expandable", "pad", True, True, False),
    ("pack, CachePreallocator", "pack", True, False, False),
    ("pack, CachePreallocator + expandable", "pack", True, True, False),
    ("pad, no row padded, CachePreallocator + expandable", "pad", True, True, True),
]


def sizes(smoke: bool) -> dict:
    if smoke:
        return dict(
            model=TINY_MODEL,
            vocab=512,
            max_length=128,
            min_length=16,
            rows=2,
            steps=6,
            docs=120,
            planner=PLANNER_SIZES[:2],
            planner_shape=(2, 64),
            planner_vocab=512,
            fsdp_shape=(2, 64),
        )
    return dict(
        model=MAIN_MODEL,
        vocab=VOCAB,
        max_length=4096,
        min_length=64,
        rows=8,
        steps=60,
        docs=1200,
        planner=PLANNER_SIZES,
        planner_shape=(4, 2048),
        planner_vocab=VOCAB,
        fsdp_shape=(4, 2048),
    )


# ------------------------------------------------------------------------------------------ shared pieces
def documents(n: int, vocab: int, max_length: int, never_padded: bool = False, seed: int = 0):
    """Pre-tokenized documents with log-normal lengths (median max_length / 4), or all longer than max_length."""
    import datasets
    import numpy as np

    g = np.random.default_rng(seed)
    if never_padded:
        lengths = g.integers(max_length + max_length // 32, 2 * max_length, n)
    else:
        lengths = np.clip(g.lognormal(math.log(max_length / 4), 1.0, n), 8, 2 * max_length).astype(int)
    ids = g.integers(1, vocab, int(lengths.sum()))
    cuts = np.cumsum(lengths)[:-1]
    return datasets.Dataset.from_dict({"input_ids": [part.tolist() for part in np.split(ids, cuts)]})


def on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def cpu_fsdp_strategy():
    """FSDP on a CPU rank (smoke runs only): the test suite's stand-in (``tests/_memory_cpu_fsdp.py``, one owner;
    a test device, not a feature of the package). On CUDA Lightning's own ``FSDPStrategy``."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from _memory_cpu_fsdp import CPUFSDPStrategy

    return CPUFSDPStrategy(process_group_backend="gloo")


def step_memory_callback():
    """Records reserved memory and allocator retries after every optimizer step (RSS on CPU)."""
    import lightning.pytorch as L
    import psutil
    import torch

    class StepMemory(L.Callback):
        def __init__(self):
            self.reserved, self.retries = [], 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if torch.cuda.is_available():
                stats = torch.cuda.memory_stats()
                self.reserved.append(stats.get("reserved_bytes.all.current", 0))
                self.retries = stats.get("num_alloc_retries", 0)
            else:
                self.reserved.append(psutil.Process().memory_info().rss)

    return StepMemory()


def fit(
    size: dict,
    data,
    strategy: str,
    prealloc: bool,
    trainer_strategy="auto",
    steps: int | None = None,
    every_n_steps: int = 7,
    shape: tuple[int, int] | None = None,
):
    """Train CausalLM with warmup; returns (StepMemory, MemoryMonitor, CachePreallocator or None, trainer)."""
    import lightning.pytorch as L

    from lightning_seqmem import CausalLM, SeqMemDataModule
    from lightning_seqmem.memory import CachePreallocator, MemoryMonitor
    from lightning_seqmem.warmup.callback import SeqLengthWarmup

    rows, length = shape or (size["rows"], size["max_length"])
    L.seed_everything(0)
    dm = SeqMemDataModule(dataset=data, strategy=strategy, max_length=length, micro_batch_size=rows, pad_token_id=0)
    model = CausalLM(
        model_config=dict(size["model"], max_position_embeddings=length), vocab_size=size["vocab"], pad_token_id=0
    )
    memory, monitor = step_memory_callback(), MemoryMonitor(every_n_steps=every_n_steps)
    pre = CachePreallocator() if prealloc else None
    warmup = SeqLengthWarmup(duration=0.5, min_seq_length=min(size["min_length"], length), max_seq_length=length)
    cuda = on_cuda()
    trainer = L.Trainer(
        max_steps=steps or size["steps"],
        accelerator="cuda" if cuda else "cpu",
        devices=1,
        strategy=trainer_strategy,
        precision="bf16-mixed" if cuda else "32-true",
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[c for c in (warmup, pre, monitor, memory) if c is not None],
    )
    trainer.fit(model, datamodule=dm)
    return memory, monitor, pre, trainer


# ------------------------------------------------------------------------------------------------ children
def child_prealloc(size: dict, name: str, strategy: str, prealloc: bool, expandable: bool, unpadded: bool) -> dict:
    from lightning_seqmem.memory.allocator import ENV_VAR, LEGACY_ENV_VAR, configure_allocator

    for var in (ENV_VAR, LEGACY_ENV_VAR):
        os.environ.pop(var, None)
    if expandable:
        configure_allocator()
    else:
        os.environ[ENV_VAR] = os.environ[LEGACY_ENV_VAR] = "expandable_segments:False"
    start = time.perf_counter()
    data = documents(size["docs"], size["vocab"], size["max_length"], never_padded=unpadded)
    memory, monitor, pre, _ = fit(size, data, strategy, prealloc)
    first, peak = memory.reserved[0], max(memory.reserved)
    return {
        "name": name,
        "after_step_1": first,
        "peak": peak,
        "growth": peak - first,
        "retries": memory.retries,
        "monitor": monitor.summary,
        "prealloc": pre.report.summary() if pre else None,
        "seconds": time.perf_counter() - start,
    }


def child_planner(size: dict) -> list[dict]:
    from lightning_seqmem.memory.estimate import estimate_training_memory
    from lightning_seqmem.memory.measured import measured_training_peak
    from lightning_seqmem.memory.worst_batch import make_dummy_batch
    from lightning_seqmem.training.building import build_model_config

    device, out = "cuda" if on_cuda() else "cpu", []
    rows, length = size["planner_shape"]
    keys, precision = ("input_ids", "attention_mask", "labels"), "bf16-mixed" if device == "cuda" else "32-true"
    for hidden, layers, heads, kv, inter in size["planner"]:
        config = build_model_config(
            dict(
                model_type="llama",
                hidden_size=hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=kv,
                intermediate_size=inter,
                max_position_embeddings=length,
            ),
            size["planner_vocab"],
            0,
        )
        est = estimate_training_memory(config, rows, length, keys, precision, device=device)
        batch = make_dummy_batch(rows, length, keys, size["planner_vocab"])
        measured = measured_training_peak(config, batch, precision, device=device)
        out.append({"params": est.num_parameters, "estimate": est.peak, "measured": measured})
    return out


def child_contamination(size: dict) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_seqmem.batching import pack_sequences
    from lightning_seqmem.batching.collate import PackCollator

    device = "cuda" if on_cuda() else "cpu"
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, 1000, (int(n),), generator=g).tolist() for n in torch.randint(8, 120, (24,), generator=g)]
    packed = pack_sequences(docs, max_length=256)
    batch = PackCollator(pad_token_id=0, max_length=256)([packed.row(r) for r in range(packed.num_rows)])
    batch = {k: v.to(device) for k, v in batch.items()}
    out = []
    for attn in ("sdpa", "eager"):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            config = LlamaConfig(
                vocab_size=1000,
                hidden_size=128,
                intermediate_size=256,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=256,
                initializer_range=0.2,
                attn_implementation=attn,
            )  # sharp attention: mixing shows
            model = LlamaForCausalLM(config).to(device, dtype).eval()
            with torch.no_grad():
                clean = model(
                    input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
                ).logits.float()  # (with a cache transformers does not unpack rows)
                mixed = model(input_ids=batch["input_ids"], use_cache=False).logits.float()  # one sequence per row
                diffs = {"clean": 0.0, "contaminated": 0.0}
                seg = 0
                for r in range(packed.num_rows):
                    start = 0
                    for n in packed.row_lengths(r):
                        doc = torch.tensor([docs[int(packed.segment_doc[seg])]], device=device)
                        seg += 1
                        logits = model(input_ids=doc, use_cache=False).logits.float()
                        alone = F.cross_entropy(logits[0, :-1], doc[0, 1:])
                        for key, logits in (("clean", clean), ("contaminated", mixed)):
                            loss = F.cross_entropy(logits[r, start : start + n - 1], doc[0, 1:])
                            diffs[key] = max(diffs[key], abs(float(loss - alone)))
                        start += n
            out.append({"attn": attn, "dtype": str(dtype).replace("torch.", ""), **diffs})
    return out


def child_fsdp(size: dict) -> dict:
    from lightning.pytorch.strategies import FSDPStrategy

    data = documents(size["docs"], size["vocab"], size["fsdp_shape"][1])
    strategy = FSDPStrategy() if on_cuda() else cpu_fsdp_strategy()
    memory, monitor, pre, trainer = fit(
        size, data, "pack", True, trainer_strategy=strategy, steps=10, every_n_steps=4, shape=size["fsdp_shape"]
    )
    loss = trainer.callback_metrics.get("train/loss")
    return {
        "steps": trainer.global_step,
        "loss": float(loss) if loss is not None else float("nan"),
        "passes": pre.report.passes,
        "prealloc": pre.report.summary(),
        "growth": max(memory.reserved) - memory.reserved[0],
        "peak": max(memory.reserved),
        "retries": memory.retries,
    }


MEMORY_CHILDREN = {
    "prealloc": child_prealloc,
    "planner": child_planner,
    "contamination": child_contamination,
    "fsdp": child_fsdp,
}
