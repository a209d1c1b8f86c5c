"""``seqmem-plan``'s fit search: the cheapest configuration of the run that fits the device budget, re-estimated.

The levers are tried in the order of what they cost the run (:data:`LEVERS`), each only when the run does not
have it already: the chunked loss (the same loss, no whole logits), gradient checkpointing (about a third more
compute), bf16 weights (``bf16-true``: no fp32 master weights), then a smaller ``micro_batch_size`` (with
``accumulate_grad_batches`` raised to keep the tokens per optimizer step), then bitsandbytes' 8-bit AdamW
(``model.optimizer=adamw_8bit``: 8-bit moments, CUDA only), then FSDP over the run's devices (each GPU holds its
share of weights, gradients and optimizer state; communication is the cost), then a LoRA adapter
(``+model/lora=default``: it changes what is trained), then QLoRA (``+model/lora=qlora``: the adapter on a 4-bit
base, which also changes the base's numerics; it needs pretrained weights and CUDA to train). The first that fits
wins; then each lever it carries is dropped again, the costliest first, when the configuration still fits without
it, so a lever that does not help (the chunked loss of a short row, whose weight gradient is allocated in forward;
LoRA once QLoRA is on) is never advised. Every peak printed is
:func:`~lightning_seqmem.memory.layer_scaling.scaled_training_memory` of that exact configuration (QLoRA traced on
:mod:`~lightning_seqmem.memory.qlora_shape`'s memory model of bitsandbytes' 4-bit layer, the 8-bit optimizer on
:mod:`~lightning_seqmem.memory.optimizer_8bit`'s); a configuration whose weights, gradients and optimizer state
alone exceed the budget (closed form, a lower bound of its peak) is not traced.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_seqmem.memory.estimate import MemoryEstimate, sharded, with_reference
from lightning_seqmem.memory.layer_scaling import cached_scaled, parameter_counts, quantized_weight_bytes
from lightning_seqmem.memory.precision import closed_form_state_bytes, normalize_precision, parameter_dtype
from lightning_seqmem.memory.stats import format_bytes
from lightning_seqmem.training.adapters import LoraSettings
from lightning_seqmem.training.linear_cross_entropy import DEFAULT_CHUNK_SIZE
from lightning_seqmem.training.loss_layer import resolve_cross_entropy

CHUNKED, CHECKPOINTING, BF16, FSDP = "chunked loss", "checkpointing", "bf16-true", "FSDP"
ADAM8, LORA, QLORA = "8-bit AdamW", "LoRA r=16", "QLoRA r=16"
LEVERS = (CHUNKED, CHECKPOINTING, BF16, ADAM8, FSDP, LORA, QLORA)
"""The levers in the order of what they cost the run (the smaller micro-batch comes after bf16-true)."""
CHEAP = (CHUNKED, CHECKPOINTING, BF16)  # tried at the run's own micro_batch_size before it is made smaller
OVERRIDES = {
    CHUNKED: "model.cross_entropy=chunked",
    CHECKPOINTING: "model.gradient_checkpointing=true",
    BF16: "trainer.precision=bf16-true",
    ADAM8: "model.optimizer=adamw_8bit",
    LORA: "+model/lora=default",  # conf/model/lora/default.yaml: r=16, all-linear, as LoraSettings()
    QLORA: "+model/lora=qlora",  # conf/model/lora/qlora.yaml: default + quantize=nf4 (pretrained_path, CUDA)
}


@dataclass(frozen=True)
class RunSettings:
    """What the run already has, as the estimate takes it.

    ``rows_per_item``: rows per unit of ``micro_batch_size`` (2 for padded preference pairs, else 1);
    ``reference_copy``: a frozen copy of the weights beside the policy (``DPO(reference="copy")``).
    """

    model_config: Any
    length: int
    keys: tuple[str, ...] = ("input_ids", "attention_mask", "labels")
    precision: str = "bf16-mixed"
    gradient_checkpointing: bool = False
    cross_entropy: str = "auto"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    micro_batch_size: int = 1
    accumulate_grad_batches: int = 1
    devices: int = 1
    fsdp: bool = False
    device: str = "cuda"
    attn_implementation: str = "sdpa"
    rows_per_item: int = 1
    reference_copy: bool = False
    lora: LoraSettings | None = None  # the run's own adapter
    optimizer: str = "adamw"  # CausalLM(optimizer=...): "adamw" or "adamw_8bit"


@dataclass
class Trial:
    """One configuration looked at: its levers, micro_batch_size, and its traced peak or its state floor."""

    levers: tuple[str, ...]
    micro_batch_size: int
    peak: int  # traced peak, or the closed-form floor when ``floor``
    floor: bool = False
    fits: bool = False


@dataclass
class FitPlan:
    """The search's answer: ``levers`` and ``micro_batch_size`` (``None``: nothing fits) with the estimate of that
    exact configuration, its overrides, what was tried and how long it took."""

    settings: RunSettings
    budget: int
    usable: int
    levers: tuple[str, ...] = ()
    micro_batch_size: int | None = None
    estimate: MemoryEstimate | None = None
    overrides: tuple[str, ...] = ()
    tried: list[Trial] = field(default_factory=list)
    seconds: float = 0.0
    message: str = ""

    @property
    def fits(self) -> bool:
        return self.micro_batch_size is not None


class FitSearch:
    """Estimates of the run with some levers on, remembered, floors first (see the module docstring)."""

    def __init__(self, run: RunSettings, usable: int) -> None:
        self.run, self.usable, self.tried = run, usable, []
        self.counts = parameter_counts(run.model_config)
        self.levers = tuple(lever for lever in LEVERS if self.applies(lever))

    def applies(self, lever: str) -> bool:
        """Whether the run lacks ``lever`` (and it can be had: FSDP needs more than one device)."""
        run = self.run
        if lever == CHUNKED:
            vocab = int(run.model_config.vocab_size)
            return resolve_cross_entropy(run.cross_entropy, vocab, run.rows_per_item * run.length) == "full"
        if lever == CHECKPOINTING:
            return not run.gradient_checkpointing
        if lever == BF16:
            return normalize_precision(run.precision) not in ("bf16-true", "16-true")
        if lever == ADAM8:
            return run.optimizer != "adamw_8bit"
        if lever == LORA:
            return run.lora is None
        if lever == QLORA:
            return run.lora is None or run.lora.quantize is None
        return run.devices > 1 and not run.fsdp

    def shards(self, levers: Sequence[str]) -> int:
        return self.run.devices if (FSDP in levers or self.run.fsdp) else 1

    def precision(self, levers: Sequence[str]) -> str:
        return "bf16-true" if BF16 in levers else self.run.precision

    def optimizer(self, levers: Sequence[str]) -> str:
        return "adamw_8bit" if ADAM8 in levers else self.run.optimizer

    def floor(self, levers: Sequence[str]) -> int:
        """Weights, gradients and optimizer state of ``levers``'s configuration (closed form, per GPU): a lower
        bound of its peak, whatever the micro-batch (8-bit moments: at least 2 bytes a parameter)."""
        parameters, tensors, _ = self.counts
        state = closed_form_state_bytes(parameters, tensors, self.precision(levers))
        adapter = self.adapter(levers)
        if adapter is not None and adapter.quantize is not None:  # the 4-bit base; the adapter's state is small
            return quantized_weight_bytes(self.run.model_config, self.precision(levers)) // self.shards(levers)
        if adapter is not None:
            return state["parameters"] // self.shards(levers)
        if self.optimizer(levers) == "adamw_8bit":
            state["optimizer_state"] = 2 * parameters
        weights = state["parameters"] * (2 if self.run.reference_copy else 1)
        return (weights + state["gradients"] + state["optimizer_state"]) // self.shards(levers)

    def adapter(self, levers: Sequence[str]) -> LoraSettings | None:
        """The adapter of ``levers``'s configuration: the run's own (made 4-bit by QLoRA), else LoRA's default."""
        own = self.run.lora
        if QLORA in levers:
            return replace(own, quantize="nf4") if own is not None else LoraSettings(quantize="nf4")
        return own if own is not None else (LoraSettings() if LORA in levers else None)

    def estimate(self, levers: Sequence[str], micro_batch_size: int) -> MemoryEstimate:
        """The traced peak of the run with ``levers`` on at ``micro_batch_size`` (one GPU's share under FSDP)."""
        run = self.run
        est = cached_scaled(
            run.model_config,
            run.rows_per_item * micro_batch_size,
            run.length,
            run.keys,
            self.precision(levers),
            run.device,
            run.attn_implementation,
            run.gradient_checkpointing or CHECKPOINTING in levers,
            cross_entropy="chunked" if CHUNKED in levers else run.cross_entropy,
            chunk_size=run.chunk_size,
            lora=self.adapter(levers),
            optimizer=self.optimizer(levers),
        )
        # DPO's reference: a frozen copy, or with an adapter the base with the adapter switched off (no copy)
        est = with_reference(est) if run.reference_copy and self.adapter(levers) is None else est
        shards = self.shards(levers)
        if shards == 1:
            return est
        # FSDP gathers one layer's weights for its forward and prefetches the next; its backward holds that
        # layer's whole gradient until the reduce-scatter: three layers' worth beside the shares.
        layer = self.counts[2] * parameter_dtype(self.precision(levers)).itemsize
        est = sharded(est, shards)
        return replace(est, peak=est.peak + 3 * layer, parameters=est.parameters + 3 * layer)

    def fits(self, levers: Sequence[str], micro_batch_size: int) -> bool:
        levers = tuple(levers)
        floor = self.floor(levers)
        if floor > self.usable:
            self.tried.append(Trial(levers, micro_batch_size, floor, floor=True))
            return False
        peak = self.estimate(levers, micro_batch_size).peak
        self.tried.append(Trial(levers, micro_batch_size, peak, fits=peak <= self.usable))
        return peak <= self.usable

    def largest(self, levers: Sequence[str], most: int) -> int | None:
        """The largest ``micro_batch_size`` up to ``most`` (a power of two below it, or itself) that fits."""
        if not self.fits(levers, 1):
            return None
        sizes = sorted({2**i for i in range(most.bit_length()) if 2**i < most} | {most})
        low, high = 0, len(sizes) - 1  # sizes[low] fits
        if self.fits(levers, sizes[high]):
            return sizes[high]
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if self.fits(levers, sizes[middle]) else (low, middle)
        return sizes[low]


def search_fit(run: RunSettings, budget: int, margin: float = 0.10) -> FitPlan:
    """The cheapest configuration of ``run`` whose peak fits ``budget`` bytes less the allocator ``margin``.

    Raises:
        ValueError: the smallest weights a lever reaches (4-bit with QLoRA, else bf16; sharded over the devices)
            exceed the budget: nothing can fit.
    """
    start = time.perf_counter()
    if not 0 <= margin < 1:
        raise ValueError(f"margin={margin} must be in [0, 1): the share of the budget kept for the allocator.")
    usable = int(budget * (1 - margin))
    search = FitSearch(run, usable)
    plan = FitPlan(run, budget, usable, tried=search.tried)
    _check_weights(search, budget, usable)
    mbs, levers, chosen = run.micro_batch_size, search.levers, None
    cheap = [lever for lever in levers if lever in CHEAP]
    for count in range(len(cheap) + 1):  # the cheap levers at the run's own micro-batch
        if search.fits(cheap[:count], mbs):
            chosen = (tuple(cheap[:count]), mbs)
            break
    if chosen is None:  # then a smaller micro-batch, then the costlier levers, each with all before it
        for count in range(len(cheap), len(levers) + 1):
            combined = _combined(levers[:count])
            size = search.largest(combined, mbs)
            if size is not None:
                chosen = (combined, size)
                break
    if chosen is not None:
        plan.levers, plan.micro_batch_size = _prune(search, *chosen)
        plan.estimate = search.estimate(plan.levers, plan.micro_batch_size)
        plan.overrides = overrides(run, plan.levers, plan.micro_batch_size)
    else:
        plan.message = _nothing_fits(search, levers)
    plan.seconds = time.perf_counter() - start
    return plan


def _combined(levers: Sequence[str]) -> tuple[str, ...]:
    """``levers`` as one configuration: an adapter trains a small part of the model, so the 8-bit optimizer is left
    out beside LoRA or QLoRA (its state is the adapter's, and bitsandbytes keeps tensors under 4,096 values, such
    as a small adapter's, in fp32: more than bf16 AdamW), and QLoRA is LoRA on a 4-bit base, so it replaces LoRA."""
    adapter = LORA in levers or QLORA in levers
    return tuple(
        lever for lever in levers if not (lever == ADAM8 and adapter) and not (lever == LORA and QLORA in levers)
    )


def _prune(search: FitSearch, levers: tuple[str, ...], size: int) -> tuple[tuple[str, ...], int]:
    """Drop each lever, the costliest first (the last one added stays), that the fit does not need at ``size``."""
    kept = list(levers)
    for lever in reversed(levers[:-1]):
        without = [other for other in kept if other != lever]
        if search.fits(without, size):
            kept = without
    return tuple(kept), size


def overrides(run: RunSettings, levers: Sequence[str], micro_batch_size: int) -> tuple[str, ...]:
    """The Hydra overrides that turn the run into the configuration found."""
    out = [OVERRIDES[lever] for lever in LEVERS if lever in levers and lever in OVERRIDES]
    if QLORA in levers and run.lora is not None:  # the run's own adapter, on a 4-bit base
        out[out.index(OVERRIDES[QLORA])] = "model.lora.quantize=nf4"
    if FSDP in levers:
        out.append(f"trainer.strategy=fsdp trainer.devices={run.devices}")
    if micro_batch_size != run.micro_batch_size:
        out.append(f"data.micro_batch_size={micro_batch_size}")
        tokens = run.micro_batch_size * run.accumulate_grad_batches
        if tokens % micro_batch_size == 0:  # the same rows per optimizer step
            out.append(f"trainer.accumulate_grad_batches={tokens // micro_batch_size}")
    return tuple(out)


def _check_weights(search: FitSearch, budget: int, usable: int) -> None:
    """The smallest weights any lever reaches (4-bit with QLoRA, else bf16), on one GPU's share, over the usable
    budget: no lever can help."""
    parameters, _, _ = search.counts
    run = search.run
    shards = run.devices if run.devices > 1 else 1
    quantized = QLORA in search.levers or (run.lora is not None and run.lora.quantize is not None)
    if quantized:  # the reference is the base with the adapter off: no copy
        weights, what = quantized_weight_bytes(run.model_config, "bf16-true") // shards, "4-bit (QLoRA) weights"
    else:
        weights, what = 2 * parameters * (2 if run.reference_copy else 1) // shards, "bf16 weights"
    if weights > usable:
        where = f" shared by {shards} GPUs (FSDP)" if shards > 1 else ""
        raise ValueError(
            f"plan.gpu_memory={format_bytes(budget)} ({format_bytes(usable)} usable) is below the model's {what} "
            f"alone ({format_bytes(weights)} for {parameters:,} parameters{where}): nothing the planner can change "
            "fits. Give a bigger plan.gpu_memory, more GPUs (plan.devices=N, trained with FSDP) or a smaller model."
        )


def _nothing_fits(search: FitSearch, levers: Sequence[str]) -> str:
    """Why nothing fits: the smallest configuration tried and what it needs."""
    best = min(search.tried, key=lambda t: t.peak)
    what = " + ".join(best.levers) or "the run as configured"
    need = "weights, gradients and optimizer state alone" if best.floor else "peak"
    return (
        f"Nothing fits {format_bytes(search.usable)} usable: the smallest tried, {what} at micro_batch_size="
        f"{best.micro_batch_size}, needs {format_bytes(best.peak)} ({need}). Try a shorter data.max_length, "
        "more GPUs (plan.devices=N, trained with FSDP) or a bigger device."
    )


def run_lora(cfg) -> LoraSettings | None:
    """The adapter of ``seqmem-plan``'s composed config (``model.lora``, e.g. ``+model/lora=qlora``), or ``None``."""
    lora = cfg.model.get("lora")
    if lora is None:
        return None
    from omegaconf import OmegaConf

    return LoraSettings.from_value(OmegaConf.to_container(lora, resolve=True))


def search_run(
    result, dm, model_config, cfg, precision: str, device: str, attention: str, devices: int, reference=False
):
    """:func:`search_fit` for ``seqmem-plan``'s composed config ``cfg``: the run of ``dm`` (keys, rows per item) at
    the worst-case length of its configured batching (``result.configured``), with the model, trainer and plan
    settings the rest of the plan used."""
    from lightning_seqmem.apps.plan_memory import parse_bytes
    from lightning_seqmem.apps.planner import MODEL_KEYS, _strategy

    settings = dm.settings.batching
    kind = dm.tokenized_documents()[1]
    per = _strategy(settings.batching, settings.max_length, settings, kind).rows_per_batch("train")
    model = cfg.model
    run = RunSettings(
        model_config,
        result.configured.max_batch_shape[1],
        tuple(k for k in dm.batch_keys() if k in MODEL_KEYS),
        precision,
        bool(model.get("gradient_checkpointing", False)),
        str(model.get("cross_entropy", "auto")),
        int(model.get("loss_chunk_size") or DEFAULT_CHUNK_SIZE),
        settings.micro_batch_size,
        int(cfg.trainer.get("accumulate_grad_batches", 1)),
        devices,
        "fsdp" in str(cfg.trainer.get("strategy", "")).lower(),
        device,
        attention,
        per // settings.micro_batch_size,
        reference,
        run_lora(cfg),
        str(model.get("optimizer", "adamw")),
    )
    return search_fit(run, parse_bytes(cfg.plan.gpu_memory), float(cfg.plan.margin))
