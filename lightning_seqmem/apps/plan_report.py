"""What ``seqmem-plan`` reports: one :class:`StrategyPlan` per batching x max_length, the recommendation, and the
text tables (``format_plan``). Pure functions of the planner's numbers (``planner.py`` computes them); no Lightning
import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_seqmem.apps.plan_memory import MemoryPlan, memory_table
from lightning_seqmem.batching.options import Batching


@dataclass(frozen=True)
class StrategyPlan:
    """One batching at one max_length, on the train split (``max_batch_shape`` over train and validation)."""

    strategy: str  # the batching's name (``Batching.spelling``): "pad", "pack_bfd"; tables and charts show it
    max_length: int
    token_efficiency: float  # real tokens / slots fed to the model in one epoch
    tokens: int  # tokens of the train documents
    tokens_lost: int  # truncated or dropped: never reach the model
    rows: int  # rows per epoch (documents, or packed rows)
    batches: int  # micro-batches per epoch, one process
    optimizer_steps: int  # per epoch, per the devices and accumulate_grad_batches given
    max_batch_shape: tuple[int, int]  # (rows, length), the largest batch of any split
    rows_dropped_per_epoch: int = 0
    trained_share: float | None = None  # conversations: tokens that carry loss / tokens fed to the model
    batching: Batching | None = None  # the options planned (``Pad(...)``, ``Truncate()``, ``Pack(...)``)

    @property
    def lost_share(self) -> float:
        return self.tokens_lost / max(self.tokens, 1)


@dataclass
class RunPlan:
    """Everything ``seqmem-plan`` prints."""

    distribution: dict[str, Any]
    strategies: list[StrategyPlan]
    configured: StrategyPlan | None
    memory: MemoryPlan | None
    recommendation: str
    recommended: dict[str, Any]
    train_lengths: np.ndarray = field(default=None, repr=False)  # [documents], for the histogram
    fit: Any = None  # the fit search's ``plan_search.FitPlan`` (with a budget and a model)
    sources: list[dict[str, Any]] = field(default_factory=list, repr=False)  # a Mix of several kinds: each source


def recommend_data(plans: Sequence[StrategyPlan], max_length: int | None = None) -> tuple[StrategyPlan, str]:
    """The plan that loses the fewest tokens, then wastes the fewest slots (to 1%), then has the max_length
    closest to ``max_length`` (the configured one: packing is ~100% efficient at any length, and shorter rows cut
    more documents); ties go to the earlier batching (``Pack(method='bfd')`` keeps documents whole,
    ``Pack(method='wrapped')`` not)."""
    target = max_length or max(p.max_length for p in plans)
    best = min(
        plans, key=lambda p: (p.tokens_lost, -round(p.token_efficiency, 2), abs(math.log2(p.max_length / target)))
    )
    lost = "no token lost" if best.tokens_lost == 0 else f"{best.lost_share:.2%} of tokens lost (the least of all)"
    return best, (
        f"strategy={best.strategy} max_length={best.max_length}: {lost}, "
        f"{best.token_efficiency:.1%} of the slots hold real tokens"
    )


def recommend(
    plans: Sequence[StrategyPlan], memory: MemoryPlan | None, micro_batch_size: int, max_length: int | None = None
) -> tuple[dict, str]:
    """``({strategy, max_length, micro_batch_size, gradient_checkpointing}, one-line reason)``; with
    ``cross_entropy='chunked'`` too when the chunked loss is what makes a (larger) micro_batch_size fit."""
    best, reason = recommend_data(plans, max_length)
    choice = {
        "strategy": best.strategy,
        "max_length": best.max_length,
        "micro_batch_size": micro_batch_size,
        "gradient_checkpointing": False,
    }
    if memory is not None and memory.usable is not None:
        if memory.chunked_fits is not None:  # larger than what fits with the full loss layer, if any
            choice.update(micro_batch_size=memory.chunked_fits, cross_entropy="chunked")
            reason += f"; cross_entropy='chunked' makes micro_batch_size={memory.chunked_fits} fit"
        elif memory.fits[False] is not None:
            choice["micro_batch_size"] = memory.fits[False]
            reason += f"; micro_batch_size={memory.fits[False]} is the largest that fits"
        elif memory.fits[True] is not None:
            choice.update(micro_batch_size=memory.fits[True], gradient_checkpointing=True)
            reason += f"; only gradient checkpointing fits, with micro_batch_size={memory.fits[True]}"
        else:
            choice["micro_batch_size"] = None
            reason += "; but nothing fits the memory budget (see above)"
    return choice, reason


def format_plan(plan: RunPlan) -> str:
    """The report as text tables."""
    lines = [*format_sources(plan.sources), *format_distribution(plan.distribution, "mixed " if plan.sources else "")]
    chat = any(s.trained_share is not None for s in plan.strategies)  # conversations: the trained share too
    width = max([18, *(len(s.strategy) for s in plan.strategies)])
    lines += [
        "",
        f"{'strategy':<{width}} max_length  efficiency"
        + ("     trained" if chat else "")
        + "        tokens lost     rows  batches   steps  largest batch",
    ]
    for s in plan.strategies:
        mark = " <- config" if plan.configured is not None and same_candidate(s, plan.configured) else ""
        trained = f"  {s.trained_share:>10.1%}" if chat else ""
        lines.append(
            f"{s.strategy:<{width}} {s.max_length:>10}  {s.token_efficiency:>10.1%}{trained}  {s.tokens_lost:>9,} "
            f"({s.lost_share:>5.1%}) {s.rows:>8,} {s.batches:>8,} {s.optimizer_steps:>7,}  "
            f"{s.max_batch_shape[0]} x {s.max_batch_shape[1]}{mark}"
        )
    lines += ["", *memory_table(plan.memory)] if plan.memory is not None else []
    lines += ["", format_fit(plan.fit)] if plan.fit is not None else []
    lines += [
        "",
        "Recommended: " + " ".join(f"{k}={v}" for k, v in plan.recommended.items()),
        "Why: " + plan.recommendation,
    ]
    return "\n".join(lines)


def format_distribution(d: dict[str, Any], mixed: str = "") -> list[str]:
    """Percentiles of the train documents and the share beyond each max_length (``planner.length_distribution``)."""
    pct = "  ".join(f"p{p}={v}" for p, v in d["percentiles"].items())
    lines = [
        f"Train documents{mixed and ' (mixed: as an epoch reads them)'}: {d['documents']:,}, {d['tokens']:,} tokens, "
        f"mean {d['mean']:.1f} tokens; {pct}",
        "max_length | documents longer | tokens beyond it",
    ]
    return lines + [f"{m:>10} | {o['documents']:>16.2%} | {o['tokens']:>16.2%}" for m, o in d["over"].items()]


def format_sources(sources: Sequence[dict[str, Any]]) -> list[str]:
    """Each source of a mix of several kinds, its own lengths (before any cut) and how often an epoch reads it."""
    if not sources:
        return []
    width, kinds = max(len(repr(s["name"])) for s in sources), max(len(s["kind"]) for s in sources)
    lines = ["Mix sources (each planned by its own kind; 'read': times over in an epoch of the mix):"]
    for s in sources:
        pct = "  ".join(f"p{p}={v}" for p, v in s["percentiles"].items())
        lines.append(
            f"  {s['name']!r:<{width}} {s['kind']:<{kinds}}  weight {s['weight']:.3g}  read {s['times']:.2f}x  "
            f"{s['documents']:,} documents, {s['tokens']:,} tokens, mean {s['mean']:.1f}; {pct}"
        )
    return [*lines, ""]


def same_candidate(a: StrategyPlan, b: StrategyPlan) -> bool:
    """Whether two plans are of the same batching options at the same max_length (the options compared as
    objects: ``Pack(method='bfd') == Pack()``)."""
    return (a.batching, a.max_length) == (b.batching, b.max_length)


LEVER_NAMES = {"FSDP": "FSDP over {devices} GPUs"}
FIT_CHOICES = {  # lever -> what the Recommended line says for it
    "chunked loss": ("cross_entropy", "chunked"),
    "checkpointing": ("gradient_checkpointing", True),
    "bf16-true": ("precision", "bf16-true"),
    "FSDP": ("strategy_fsdp", True),
    "8-bit AdamW": ("optimizer", "adamw_8bit"),
    "LoRA r=16": ("lora", "default"),
    "QLoRA r=16": ("lora", "qlora"),
}


def attach_fit(plan: RunPlan, fit) -> None:
    """Put the fit search's answer on ``plan``; when the memory table found no micro_batch_size for the configured
    max_length, the Recommended line takes the search's levers and micro_batch_size (``cross_entropy='chunked'``,
    ``precision='bf16-true'`` ... by name)."""
    plan.fit = fit
    configured = plan.configured.max_length if plan.configured is not None else None
    if not fit.fits or plan.recommended.get("micro_batch_size") is not None:
        return
    if plan.recommended.get("max_length") != configured:
        return
    plan.recommended["micro_batch_size"] = fit.micro_batch_size
    plan.recommended.update(FIT_CHOICES[lever] for lever in fit.levers)
    plan.recommendation = plan.recommendation.replace("; but nothing fits the memory budget (see above)", "")
    plan.recommendation += f"; the fit search's configuration (Fits: above) at micro_batch_size={fit.micro_batch_size}"


def format_fit(fit) -> str:
    """The fit search's answer in one line (``plan_search.FitPlan``): model size, row length, budget, the levers
    that make it fit, the micro_batch_size, the re-estimated peak of exactly that configuration and its overrides;
    or why nothing fits."""
    from lightning_seqmem.memory.layer_scaling import parameter_counts
    from lightning_seqmem.memory.stats import format_bytes

    run = fit.settings
    parameters = parameter_counts(run.model_config)[0]
    size = f"{parameters / 1e9:.1f}B" if parameters >= 1e9 else f"{parameters / 1e6:.0f}M"
    head = f"Fits: {size}, {run.length:,} tokens, {format_bytes(fit.budget)}"
    took = f" (searched in {fit.seconds:.1f} s)"
    if not fit.fits:
        return f"{head}: {fit.message}{took}"
    names = [LEVER_NAMES.get(lever, lever).format(devices=run.devices) for lever in fit.levers]
    est = fit.estimate
    return (
        f"{head}: {' + '.join(names) or 'as configured'}, micro_batch_size={fit.micro_batch_size}, peak "
        f"{format_bytes(est.peak)} of {format_bytes(fit.usable)} usable, as overrides: "
        f"{' '.join(fit.overrides) or '(none)'}{took}"
    )
