"""The tracer's check: the peak live tensor bytes of the same training steps, run for real and measured by torch.

No bookkeeping of ours is involved. On CPU, ``torch.profiler`` records every allocation and free of torch's
allocators (``profile_memory=True``), and the peak of their running sum is the peak of live tensor bytes; on CUDA,
the caching allocator's own ``max_memory_allocated`` after ``reset_peak_memory_stats``. ``tests`` compare
:func:`~lightning_seqmem.memory.estimate.estimate_training_memory` with it on CPU, ``benchmarks/gpu.py`` on a GPU.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from lightning_seqmem.memory.fake_model import build_model
from lightning_seqmem.memory.precision import normalize_precision, parameter_dtype
from lightning_seqmem.memory.qlora_shape import quantize_linears
from lightning_seqmem.memory.trace import adamw, lightning_steps
from lightning_seqmem.training.adapters import LoraSettings, import_peft
from lightning_seqmem.training.building import enable_checkpointing
from lightning_seqmem.training.linear_cross_entropy import DEFAULT_CHUNK_SIZE


def measured_peak_bytes(run: Callable[[], Any], device: str | torch.device = "cpu") -> int:
    """Peak live tensor bytes of the real allocations ``run()`` makes on ``device``, above what was allocated before.

    CPU: from ``torch.profiler``'s allocation events (build the model inside ``run`` so its weights count). CUDA:
    ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, less the bytes allocated before ``run``.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        run()
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    live = peak = 0
    for _, size in profiled_allocations(prof):
        live += size
        peak = max(peak, live)
    return peak


def profiled_events(prof) -> Iterator[Any]:
    """Every event of a finished ``torch.profiler`` run (``profile_memory=True``), allocations included."""
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        yield event
        stack.extend(event.children)


def profiled_allocations(prof) -> list[tuple[int, int]]:
    """``(time_ns, bytes)`` of every allocation (bytes > 0) and free (bytes < 0) in a profile, in time order:
    their running sum is the live tensor bytes since profiling started."""
    from torch._C._profiler import _EventType

    return sorted(
        (event.start_time_ns, event.typed[1].alloc_size)
        for event in profiled_events(prof)
        if event.typed[0] == _EventType.Allocation
    )


def measured_training_peak(
    model_config,
    batch: Mapping[str, torch.Tensor],
    precision: str = "32-true",
    attn_implementation: str = "sdpa",
    gradient_checkpointing: bool = False,
    seed: int = 0,
    device: str | torch.device = "cpu",
    cross_entropy: str = "full",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    lora: LoraSettings | Mapping[str, Any] | None = None,
) -> int:
    """Peak live tensor bytes of the steps :func:`~lightning_seqmem.memory.estimate.estimate_training_memory`
    traces, run for real on ``device`` (``"cpu"`` or ``"cuda"``).

    The model (real random weights, built before and copied inside the measured region: building a model with tied
    embeddings makes an untied head's weight first, a transient the training step never holds) and the batch's
    copy on ``device`` are made inside the measured region, so they count; measured with
    :func:`measured_peak_bytes`, not with the tracer's ``LiveBytes``. ``cross_entropy``
    (``"full"`` or ``"chunked"``) and ``chunk_size`` choose the loss layer, as in the estimate. ``lora``: PEFT's
    LoRA on the model, its adapter in the precision's parameter dtype (as Lightning's ``*-true`` casts it);
    ``quantize="nf4"``: on the base with :mod:`~lightning_seqmem.memory.qlora_shape`'s 4-bit stand-ins (quantized
    before the measured region: a 4-bit load never holds the full-precision weights).
    """
    precision = normalize_precision(precision)
    settings = LoraSettings.from_value(lora)
    torch.manual_seed(seed)
    with torch.device(device):
        built = build_model(model_config, attn_implementation, precision)
    if settings is not None and settings.quantize is not None:
        built = quantize_linears(built)

    def run() -> None:
        torch.manual_seed(seed)
        model = copy.deepcopy(built)
        if gradient_checkpointing:
            enable_checkpointing(model)
        if settings is not None:
            model = with_adapter(model, settings, precision)
        optimizer = adamw(model, torch.device(device).type)
        batch_there = {k: v.to(device) for k, v in batch.items()}
        lightning_steps(model, optimizer, batch_there, precision, cross_entropy=cross_entropy, chunk_size=chunk_size)

    return measured_peak_bytes(run, device)


def with_adapter(model: torch.nn.Module, settings: LoraSettings, precision: str) -> torch.nn.Module:
    """``model`` with PEFT's LoRA of ``settings`` (the base frozen), the adapter in ``precision``'s parameter dtype."""
    wrapped = import_peft().get_peft_model(model, settings.peft_config(), autocast_adapter_dtype=False).train()
    dtype = parameter_dtype(precision)
    for p in wrapped.parameters():
        if p.requires_grad and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return wrapped
