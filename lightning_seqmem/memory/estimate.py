"""The memory estimate: the peak training memory of a model config and batch shape, before anything is allocated.

:func:`estimate_training_memory` traces a steady-state training step on fake tensors
(:mod:`~lightning_seqmem.memory.trace`: how, and what follows the GPU for ``device="cuda"``) and returns a
:class:`MemoryEstimate`, the peak split by category. Around it: the search for the largest ``micro_batch_size``
that fits, the per-rank share under FSDP, and the shortfall message ``CachePreallocator`` and ``ConfigChecks`` warn
with. The real steps it is checked against are in :mod:`~lightning_seqmem.memory.measured`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from lightning_seqmem.memory.adapter_trace import add_fake_lora
from lightning_seqmem.memory.fake_model import build_fake_model
from lightning_seqmem.memory.model_facts import model_facts
from lightning_seqmem.memory.optimizer_8bit import traced_optimizer
from lightning_seqmem.memory.precision import normalize_precision
from lightning_seqmem.memory.trace import (
    CUDA_GRANULE,
    LiveBytes,
    steady_state,
    trace_errors,
    trace_training_steps,
)
from lightning_seqmem.memory.worst_batch import make_dummy_batch
from lightning_seqmem.training.adapters import LoraSettings
from lightning_seqmem.training.linear_cross_entropy import DEFAULT_CHUNK_SIZE
from lightning_seqmem.training.loss_layer import check_cross_entropy, resolve_cross_entropy


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak live tensor bytes of a training step, split by category at the peak (the four add up to ``peak``).

    ``state`` holds the full parameter, gradient and optimizer-state bytes (all alive right after
    ``optimizer.step()``), which the split at the peak can show only partly when the peak falls in backward.
    ``loss_layer`` is the part of ``activations`` at the peak that the loss layer made (its logits, their fp32
    upcast and their gradient on the full path), ``cross_entropy`` the loss layer traced (``"auto"`` decided).
    """

    rows: int
    length: int
    device: str
    precision: str
    attn_implementation: str
    gradient_checkpointing: bool
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    peak: int
    peak_phase: str  # forward | backward | optimizer
    num_parameters: int
    state: Mapping[str, int]
    cross_entropy: str = "full"
    loss_layer: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def checked_arguments(model_config, rows, length, device, precision, cross_entropy, chunk_size) -> tuple[str, str]:
    """``(precision, cross_entropy)`` of an estimate, checked and resolved (``"auto"`` decided for this vocabulary
    and batch): the one check of every estimate's arguments, traced whole or scaled from a few layers.

    Raises:
        ValueError: rows or length not an int >= 1, an unknown device, precision or loss choice.
    """
    if not (isinstance(rows, int) and isinstance(length, int)) or rows < 1 or length < 1:
        raise ValueError(f"rows and length must be ints >= 1, got rows={rows!r}, length={length!r}.")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r}: estimates are for 'cuda' or 'cpu'.")
    precision = normalize_precision(precision)
    check_cross_entropy(cross_entropy, chunk_size)
    return precision, resolve_cross_entropy(cross_entropy, int(model_config.vocab_size), rows * length)


def estimate_training_memory(
    model_config,
    rows: int,
    length: int,
    keys: Sequence[str] = ("input_ids", "attention_mask", "labels"),
    precision: str = "32-true",
    device: str = "cuda",
    attn_implementation: str = "sdpa",
    gradient_checkpointing: bool = False,
    model: tuple[Any, torch.nn.Module] | None = None,
    cross_entropy: str = "full",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    lora: LoraSettings | Mapping[str, Any] | None = None,
    optimizer: str = "adamw",
) -> MemoryEstimate:
    """Peak live tensor bytes of training ``model_config`` on ``[rows, length]`` batches, traced on fake tensors.

    Args:
        model_config: a ``transformers`` config (``lightning_seqmem.training.building.build_model_config`` builds
            one from the presets).
        rows, length: the batch shape (the run's worst case: ``SeqMemDataModule.max_batch_shape()``).
        keys: the batch keys (``batch_keys()``): padded batches carry an ``attention_mask``, packed ones
            ``position_ids``.
        precision: a Lightning precision (see :data:`PRECISIONS`).
        device: ``"cuda"`` (foreach AdamW, 512-byte allocator granule) or ``"cpu"``.
        attn_implementation: ``"sdpa"``, ``"eager"`` or ``"flash_attention_2"``.
        gradient_checkpointing: recompute each layer's activations in backward.
        model: a ``(mode, model)`` pair from :func:`build_fake_model` to reuse (its parameters must have no
            gradients and its optimizer no state: pass a fresh one per estimate, or leave ``None``).
        cross_entropy: the loss layer, as ``CausalLM(cross_entropy=...)`` takes it (``"auto"`` decided on
            ``rows * length`` tokens, as ``CausalLM`` decides it on the DataModule's largest batch; ``"liger"`` is
            traced as ``"chunked"``, whose memory is of the same order).
        chunk_size: tokens per chunk of the chunked loss (``CausalLM``'s ``loss_chunk_size``).
        lora: a LoRA adapter on the model (``CausalLM``'s ``lora``): the base frozen, gradients and optimizer state
            of the adapter only (:func:`~lightning_seqmem.memory.adapter_trace.add_fake_lora`); not with ``model``.
            ``quantize="nf4"`` (QLoRA) traces the base's linear layers as bitsandbytes' 4-bit layers hold them
            (:mod:`~lightning_seqmem.memory.qlora_shape`: their memory, not their numerics).
        optimizer: ``"adamw"`` (torch's) or ``"adamw_8bit"`` (bitsandbytes' ``AdamW8bit``: 8-bit moments,
            :mod:`~lightning_seqmem.memory.optimizer_8bit`), as ``CausalLM(optimizer=...)``.

    Raises:
        ValueError: a shape below 1, an unknown precision, device or attention implementation.
        TraceError: the model uses an op the tracer cannot run (the message names it).

    Example::

        from lightning_seqmem.training.building import build_model_config
        est = estimate_training_memory(build_model_config("tiny_llama", 32000, 0), rows=8, length=2048)
        est.peak, est.activations
    """
    precision, cross_entropy = checked_arguments(
        model_config, rows, length, device, precision, cross_entropy, chunk_size
    )
    traced = "chunked" if cross_entropy == "liger" else cross_entropy
    mode, module = model or build_fake_model(model_config, attn_implementation, precision, gradient_checkpointing)
    if lora is not None and model is None:
        module = add_fake_lora(mode, module, lora, precision)
    granule = CUDA_GRANULE if device == "cuda" else 1
    # The pre-allocation pass's batch (real, small: made outside the mode, which turns it into fake tensors)
    batch = make_dummy_batch(rows, length, keys, int(model_config.vocab_size))
    tracker = LiveBytes(granule)
    with trace_errors(model_config), mode:
        stepper = traced_optimizer(module, device, optimizer)
        steady_state(module, stepper, tracker)  # the first step's gradients and optimizer state: one step traced
        trace_training_steps(module, stepper, batch, precision, 1, granule, traced, chunk_size, tracker=tracker)
    split = tracker.split()
    state = tracker.live_split()
    del state["activations"]
    params = [p for p in module.parameters()]
    module.zero_grad(set_to_none=True)  # the model can be traced again
    return MemoryEstimate(
        rows=rows,
        length=length,
        device=device,
        precision=precision,
        attn_implementation=attn_implementation,
        gradient_checkpointing=gradient_checkpointing,
        peak=tracker.peak,
        peak_phase=tracker.peak_phase,
        num_parameters=sum(p.numel() for p in params),
        state=state,
        cross_entropy=cross_entropy,
        loss_layer=tracker.loss_layer(),
        **split,
    )


def largest_fitting(estimate: Callable[[int], MemoryEstimate], budget: int, candidates: Sequence[int]):
    """The largest candidate ``micro_batch_size`` whose ``estimate(rows).peak <= budget`` and all estimates made.

    Memory grows with rows, so the search stops at the first candidate (in increasing order) that does not fit.
    Returns ``(best or None, {rows: MemoryEstimate})``.
    """
    best, seen = None, {}
    for rows in sorted(set(candidates)):
        seen[rows] = estimate(rows)
        if seen[rows].peak > budget:
            break
        best = rows
    return best, seen


_ESTIMATES: dict[tuple, MemoryEstimate] = {}


def cached_estimate(
    model_config,
    rows: int,
    length: int,
    keys: Sequence[str],
    precision: str = "32-true",
    device: str = "cuda",
    attn_implementation: str = "sdpa",
    gradient_checkpointing: bool = False,
    cross_entropy: str = "full",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    lora: LoraSettings | None = None,
    optimizer: str = "adamw",
) -> MemoryEstimate:
    """:func:`estimate_training_memory`, remembered per (config, shape, settings) for this process, so the
    callbacks that ask the same question (``ConfigChecks``, ``CachePreallocator``) trace once."""
    key = (
        model_config.to_json_string(),
        rows,
        length,
        tuple(keys),
        normalize_precision(precision),
        device,
        attn_implementation,
        gradient_checkpointing,
        cross_entropy,
        chunk_size,
        lora,
        optimizer,
    )
    if key not in _ESTIMATES:
        _ESTIMATES[key] = estimate_training_memory(
            model_config,
            rows,
            length,
            keys,
            precision,
            device,
            attn_implementation,
            gradient_checkpointing,
            cross_entropy=cross_entropy,
            chunk_size=chunk_size,
            lora=lora,
            optimizer=optimizer,
        )
    return _ESTIMATES[key]


def module_facts(pl_module: torch.nn.Module) -> dict[str, Any] | None:
    """The estimate's arguments ``model_config``, ``attn_implementation``, ``gradient_checkpointing``,
    ``cross_entropy``, ``chunk_size`` and ``lora`` for a LightningModule wrapping a Hugging Face model as ``.model``
    (like ``CausalLM``; PEFT-wrapped too), read by
    :func:`~lightning_seqmem.memory.model_facts.model_facts`; ``None`` for anything else (nothing to trace), and for
    an adapter the tracer cannot rebuild (another PEFT method than LoRA; a 4-bit base is traced on the stand-in of
    :mod:`~lightning_seqmem.memory.qlora_shape`)."""
    facts = model_facts(pl_module)
    if facts.config is None or not facts.traceable_adapter:
        return None
    return {
        "model_config": facts.config,
        "attn_implementation": facts.attn_implementation or "sdpa",
        "gradient_checkpointing": facts.gradient_checkpointing,
        "cross_entropy": facts.cross_entropy,
        "chunk_size": facts.loss_chunk_size,
        "lora": facts.lora,
    }


def with_reference(est: MemoryEstimate) -> MemoryEstimate:
    """``est`` with a frozen copy of the weights beside the policy (DPO's reference model): its parameters stay
    resident through the step (counted under ``parameters`` and ``state["reference"]``); its forward runs under
    ``no_grad`` before the policy's and frees its activations long before the policy's backward peak."""
    reference = est.state.get("parameters", est.parameters)
    return replace(
        est,
        parameters=est.parameters + reference,
        peak=est.peak + reference,
        state={**est.state, "reference": reference},
    )


def sharded(est: MemoryEstimate, shards: int) -> MemoryEstimate:
    """``est`` on one of ``shards`` ranks that split weights, gradients and optimizer state (FSDP full shard)."""
    if shards <= 1:
        return est
    whole = {"parameters": est.parameters, "gradients": est.gradients, "optimizer_state": est.optimizer_state}
    split = {name: value // shards for name, value in whole.items()}
    return replace(est, peak=est.peak - sum(whole.values()) + sum(split.values()), **split)


def shortfall_message(
    model_config,
    shape: tuple[int, int],
    keys: Sequence[str],
    available: int,
    precision: str = "32-true",
    attn_implementation: str = "sdpa",
    gradient_checkpointing: bool = False,
    device: str = "cuda",
    shards: int = 1,
    cross_entropy: str = "full",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    lora: LoraSettings | None = None,
) -> str | None:
    """When the traced peak of a ``shape`` training step exceeds ``available`` bytes: a message with the peak, its
    split and the largest ``micro_batch_size`` (rows) that fits; ``None`` when it fits.

    Args:
        model_config: the ``transformers`` config of the model.
        shape: the worst-case ``(rows, length)``.
        keys: the batch keys.
        available: bytes the step may use (free device memory plus what the model already holds there).
        precision, attn_implementation, gradient_checkpointing, device, cross_entropy, chunk_size, lora: as in
            :func:`estimate_training_memory`.
        shards: ranks that share weights, gradients and optimizer state (FSDP's world size): each holds a
            ``1/shards`` part of them (the gathered layer in flight is not counted).
    """
    from lightning_seqmem.memory.stats import format_bytes

    rows, length = shape
    settings = (keys, precision, device, attn_implementation, gradient_checkpointing, cross_entropy, chunk_size, lora)

    def estimate(r: int) -> MemoryEstimate:
        return sharded(cached_estimate(model_config, r, length, *settings), shards)

    est = estimate(rows)
    if est.peak <= available:
        return None
    smaller = [2**i for i in range(rows.bit_length()) if 2**i < rows]
    best, _ = largest_fitting(estimate, available, smaller)
    fix = (
        f"micro_batch_size={best} fits"
        if best is not None
        else "not even micro_batch_size=1 fits: use gradient checkpointing, a shorter max_length or bf16"
    )
    if est.cross_entropy == "full" and est.loss_layer:
        fix += f"; the loss layer is {format_bytes(est.loss_layer)} of the peak: cross_entropy='chunked' shrinks it"
    if lora is None:
        fix += (
            f"; gradients and optimizer state ({format_bytes(est.gradients + est.optimizer_state)}) are the whole "
            "model's: a LoRA adapter (CausalLM(lora=dict(r=16)), or peft.get_peft_model) trains a small part of it"
        )
    return (
        f"Predicted peak training memory for the worst-case batch {rows} x {length} is {format_bytes(est.peak)} "
        f"(parameters {format_bytes(est.parameters)}, gradients {format_bytes(est.gradients)}, optimizer state "
        f"{format_bytes(est.optimizer_state)}, activations {format_bytes(est.activations)}; traced, "
        f"{precision}, {attn_implementation}), more than the {format_bytes(available)} available: {fix}. "
        "seqmem-plan prints the whole table."
    )
