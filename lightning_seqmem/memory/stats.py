"""Memory arithmetic: pure functions on numbers and ``torch.cuda.memory_stats()`` dicts (no torch import).

Shared by :class:`~lightning_seqmem.memory.CachePreallocator`, :class:`~lightning_seqmem.memory.MemoryMonitor` and
``benchmarks/memory.py``, and testable without a GPU.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence

GIB = 1024**3

# torch.cuda.memory_stats() keys -> our metric names (bytes are converted to GiB).
_CUDA_KEYS = {
    "allocated_bytes.all.current": "allocated_gib",
    "reserved_bytes.all.current": "reserved_gib",
    "allocated_bytes.all.peak": "peak_allocated_gib",
    "reserved_bytes.all.peak": "peak_reserved_gib",
    "inactive_split_bytes.all.current": "inactive_split_gib",
    "inactive_split_bytes.all.peak": "peak_inactive_split_gib",
    "num_alloc_retries": "num_alloc_retries",
    "num_ooms": "num_ooms",
    "num_device_alloc": "num_device_alloc",  # cudaMalloc calls (torch >= 2.1)
    "num_device_free": "num_device_free",
}

FIXES = (
    "a smaller micro_batch_size",
    "a smaller max_length, or a smaller max_tokens_per_batch (token-budget batches)",
    "gradient checkpointing (CausalLM(gradient_checkpointing=True))",
    "bf16 (precision='bf16-mixed', or resolve_precision('auto'))",
)


def format_bytes(n: float | None) -> str:
    """``1536 * 2**20`` -> ``'1.50 GiB'``; ``None`` -> ``'unknown'``."""
    if n is None:
        return "unknown"
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def stranded_share(inactive_split: float, reserved: float) -> float:
    """Fragmentation: the share of reserved memory in inactive split blocks (``inactive_split_bytes``), the free
    remainders of split blocks that the allocator cannot merge into a larger request (0 if nothing reserved)."""
    return inactive_split / reserved if reserved > 0 else 0.0


def cuda_memory_metrics(stats: Mapping[str, int | float]) -> dict[str, float]:
    """Flat metrics from a ``torch.cuda.memory_stats()`` dict (missing keys are skipped).

    Returns GiB for sizes, counts as floats, and ``fragmentation`` (:func:`stranded_share`) at the peak: the most
    bytes ever in inactive split blocks over the most ever reserved (the current values without peaks). Sampled
    after a step, when most of a pre-allocated reservation is free but reusable, ``(reserved - allocated) /
    reserved`` would measure the reservation instead.

    Example::

        cuda_memory_metrics({"reserved_bytes.all.peak": 2**33, "inactive_split_bytes.all.peak": 2**30})
        # {'peak_reserved_gib': 8.0, 'peak_inactive_split_gib': 1.0, 'fragmentation': 0.125}
    """
    metrics: dict[str, float] = {}
    for key, name in _CUDA_KEYS.items():
        if key in stats:
            value = float(stats[key])
            metrics[name] = value / GIB if name.endswith("_gib") else value
    for split, reserved in (("peak_inactive_split_gib", "peak_reserved_gib"), ("inactive_split_gib", "reserved_gib")):
        if split in metrics and reserved in metrics:
            metrics["fragmentation"] = stranded_share(metrics[split], metrics[reserved])
            break
    return metrics


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (``ru_maxrss``: KiB on Linux, bytes on macOS).

    The kernel updates its high-water mark lazily, so it can trail the current RSS by a few pages: take the larger.
    """
    import resource

    import psutil

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max(int(peak if sys.platform == "darwin" else peak * 1024), psutil.Process().memory_info().rss)


def cpu_memory_metrics() -> dict[str, float]:
    """Current and peak RSS of this process in GiB."""
    import psutil

    return {"rss_gib": psutil.Process().memory_info().rss / GIB, "peak_rss_gib": peak_rss_bytes() / GIB}


def parse_tried_to_allocate(message: str) -> int | None:
    """Bytes from torch's ``"Tried to allocate 2.00 GiB"`` in an OOM message, or ``None``."""
    match = re.search(r"Tried to allocate ([\d.]+) ?([KMGT]?i?B)", message)
    if not match:
        return None
    units = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4, "KB": 1e3, "MB": 1e6, "GB": 1e9}
    return int(float(match.group(1)) * units.get(match.group(2), 1))


def oom_message(
    shape: tuple[int, int],
    keys: Sequence[str],
    device: str,
    needed: int | None,
    free: int | None,
    total: int | None,
    held: int | None = None,
    cause: str = "",
) -> str:
    """The error text for a worst-case batch that does not fit: what was tried, needed vs available, ways out.

    Args:
        shape: the ``(rows, length)`` that failed.
        keys: the batch keys.
        device: where it ran.
        needed: bytes the step needs beyond ``held`` (at least: peak before the failure plus the failed request).
        free: bytes free on the device (or in RAM).
        total: the device's (or machine's) capacity.
        held: bytes held by tensors that outlive the step (weights, optimizer state), if known.
        cause: the original error text.
    """
    rows, length = shape
    lines = [
        f"The largest batch this run will see does not fit in {device} memory: the pre-allocation pass "
        f"(one forward and backward through training_step) ran out of memory at rows={rows}, length={length} "
        f"({rows * length:,} tokens per micro-batch, keys {tuple(keys)}).",
        f"Memory needed: at least {format_bytes(needed)}"
        + (f" on top of the {format_bytes(held)} already held (weights, optimizer state)" if held is not None else "")
        + f"; available: {format_bytes(free)} free of {format_bytes(total)}.",
        "It would have failed the first time a batch this large came up. Ways out (any one, or several):",
        *(f"  - {fix}" for fix in FIXES),
    ]
    if cause:
        lines.append(f"Original error: {cause.strip().splitlines()[0]}")
    return "\n".join(lines)


def memory_advice(
    num_alloc_retries: float,
    peak_fragmentation: float,
    threshold: float,
    preallocating: bool = False,
    expandable: bool = False,
) -> str | None:
    """A warning with the fixes not yet in place when allocator retries or fragmentation are high; ``None`` when all
    is well. ``preallocating``/``expandable``: the run already has ``CachePreallocator`` / expandable segments."""
    problems = []
    if num_alloc_retries > 0:
        problems.append(
            f"{int(num_alloc_retries)} allocation retries (the allocator freed its cache and synchronised to "
            "satisfy a request: slow, and one step from OOM)"
        )
    if peak_fragmentation > threshold:
        problems.append(
            f"fragmentation {peak_fragmentation:.0%} (> {threshold:.0%}) of reserved memory stranded in split blocks"
        )
    if not problems:
        return None
    fixes = (
        []
        if expandable
        else [
            "enable expandable segments (lightning_seqmem.memory.allocator.configure_allocator() before importing "
            "torch, or PYTORCH_ALLOC_CONF=expandable_segments:True)"
        ]
    )
    if not preallocating:
        fixes.append("add CachePreallocator so the largest batch is reserved first")
    fixes.append("keep shapes steady (strategy='truncate', or pack with a fixed max_length)")
    return "Memory: " + "; ".join(problems) + ". Fixes: " + ", ".join(fixes) + "."
