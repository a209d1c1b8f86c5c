"""The planner's memory half: peak training memory per micro_batch_size, what fits a budget, and its table.

Estimates come from ``memory/estimate.py`` (training steps traced on fake tensors); this module only searches the
candidates, says what would fit, and lays the numbers out. Each estimate says how much of its peak is the loss
layer's (the logits, their fp32 upcast and their gradient on the full path); where the full loss layer leaves a
candidate too big, the chunked one (``cross_entropy="chunked"``) is estimated too and recommended when it fits.
No Lightning import.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_seqmem.memory.estimate import largest_fitting
from lightning_seqmem.memory.stats import format_bytes

DEFAULT_MARGIN = 0.10  # of the budget, held back for the caching allocator's fragmentation and the CUDA context


def parse_bytes(value: str | int | float) -> int:
    """``"80GiB"``, ``"80 GB"``, ``"512MiB"`` or a number of bytes -> bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]i?B|B)?\s*", str(value), flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"Cannot read a memory size from {str(value)[:40]!r}; write e.g. 80GiB, 40GB or 512MiB.")
    units = {
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }
    return int(float(match.group(1)) * units[(match.group(2) or "B").lower()])


@dataclass
class MemoryPlan:
    """Predicted peak memory per micro_batch_size at one worst-case length, with and without checkpointing."""

    length: int
    budget: int | None
    margin: float
    estimates: dict[bool, dict[int, Any]] = field(default_factory=dict)  # checkpointing -> rows -> MemoryEstimate
    fits: dict[bool, int | None] = field(default_factory=dict)  # checkpointing -> largest rows within budget
    advice: str = ""
    chunked: dict[int, Any] = field(default_factory=dict)  # rows -> MemoryEstimate with cross_entropy="chunked"
    chunked_fits: int | None = None  # largest rows within budget with the chunked loss, no checkpointing

    @property
    def usable(self) -> int | None:
        return None if self.budget is None else int(self.budget * (1 - self.margin))


def plan_memory(
    estimate: Callable[[int, int, bool], Any],
    length: int,
    micro_batch_sizes: Sequence[int],
    budget: int | None = None,
    margin: float = DEFAULT_MARGIN,
    shorter_lengths: Sequence[int] = (),
) -> MemoryPlan:
    """Peak memory for each micro_batch_size, with and without gradient checkpointing, and what fits ``budget``.

    Args:
        estimate: ``(rows, length, gradient_checkpointing) -> MemoryEstimate``. One that also takes a
            ``cross_entropy`` keyword, and whose estimates trace the full loss layer, is asked again with
            ``cross_entropy="chunked"`` for the candidates too big without checkpointing.
        length: the worst-case row length.
        micro_batch_sizes: candidates; with a budget the search stops at the first that does not fit.
        budget: device memory in bytes (``None``: no fitting, every candidate estimated).
        margin: share of ``budget`` held back for allocator overhead.
        shorter_lengths: max_lengths to suggest when not even one row fits.
    """
    if not 0 <= margin < 1:
        raise ValueError(f"margin={margin} must be in [0, 1): the share of the budget kept for the allocator.")
    if not micro_batch_sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in micro_batch_sizes):
        raise ValueError(f"micro_batch_sizes must be a non-empty list of ints >= 1, got {list(micro_batch_sizes)[:8]}.")
    sizes = sorted(set(micro_batch_sizes))
    out = MemoryPlan(length=length, budget=budget, margin=margin)
    limit = out.usable if out.usable is not None else math.inf
    for checkpointing in (False, True):
        fits, out.estimates[checkpointing] = largest_fitting(
            lambda rows: estimate(rows, length, checkpointing), limit, sizes
        )
        out.fits[checkpointing] = fits if out.usable is not None else None
    if out.usable is not None:
        _chunked_fits(estimate, out, sizes, limit)
    if out.usable is not None and out.fits[False] is None:
        out.advice = _no_fit_advice(estimate, out, shorter_lengths)
    return out


def _chunked_fits(estimate, memory: MemoryPlan, sizes: Sequence[int], limit: float) -> None:
    """With the full loss layer traced: estimate the chunked one for the candidates too big without checkpointing,
    and say so in the advice when it makes one fit."""
    traced = list(memory.estimates[False].values())
    if "cross_entropy" not in inspect.signature(estimate).parameters or traced[0].cross_entropy != "full":
        return
    full = memory.fits[False]
    bigger = [rows for rows in sizes if full is None or rows > full]
    if not bigger:
        return
    memory.chunked_fits, memory.chunked = largest_fitting(
        lambda rows: estimate(rows, memory.length, False, cross_entropy="chunked"), limit, bigger
    )
    if memory.chunked_fits is not None:
        one = memory.estimates[False][min(memory.estimates[False])]
        memory.advice = (
            f"cross_entropy='chunked' (model.cross_entropy=chunked) fits micro_batch_size={memory.chunked_fits}"
            f" ({'none' if full is None else full} with the full loss layer, whose logits, upcast and gradient "
            f"are {format_bytes(one.loss_layer)} of one row's {format_bytes(one.peak)} peak)."
        )


def _no_fit_advice(estimate, memory: MemoryPlan, shorter_lengths: Sequence[int]) -> str:
    one = memory.estimates[False][min(memory.estimates[False])]
    ways = []
    if memory.chunked_fits is not None:
        ways.append(f"cross_entropy='chunked' fits micro_batch_size={memory.chunked_fits}")
    if memory.fits[True] is not None:
        ways.append(
            f"gradient checkpointing (model.gradient_checkpointing=true) fits micro_batch_size={memory.fits[True]}"
        )
    for length in sorted((m for m in shorter_lengths if m < memory.length), reverse=True):
        if estimate(1, length, False).peak <= memory.usable:
            ways.append(f"data.max_length={length} fits micro_batch_size=1")
            break
    # Nothing unchecked: bf16 weights, a smaller micro-batch, FSDP and the rest are estimated by the fit search
    ways = ways or ["nothing of these; the fit search below ('Fits:') tries the other levers, each estimated"]
    return (
        f"No micro_batch_size fits {format_bytes(memory.budget)} ({format_bytes(memory.usable)} usable after a "
        f"{memory.margin:.0%} allocator margin) at length {memory.length}: one row needs {format_bytes(one.peak)}. "
        "What would fit: " + "; ".join(ways) + "."
    )


# What is live at a peak in each phase of the traced step (forward, zero_grad, backward, optimizer step).
PEAK_NOTES = {
    "forward": "the previous step's gradients are still alive (zero_grad frees them after the forward).",
    "backward": "the forward's saved activations are alive and this step's gradients are not all written yet "
    "('none yet of X': zero_grad freed the previous ones); they come later, below the peak.",
    "optimizer": "parameters, gradients and AdamW state are all alive, with the optimizer step's temporaries.",
}


def memory_table(memory: MemoryPlan) -> list[str]:
    """The memory table's lines: per micro_batch_size, the peak, the phase it falls in and what is live then."""
    lines = [
        f"Peak training memory at length {memory.length} (worst case of the configured run)"
        + (
            f"; budget {format_bytes(memory.budget)}, {format_bytes(memory.usable)} usable after a "
            f"{memory.margin:.0%} allocator margin"
            if memory.budget
            else ""
        ),
        f"{'':>65}{' live at the peak ':-^82}",
        "micro_batch_size  checkpointing  loss layer        peak  falls in    parameters  gradients             "
        "   optimizer  activations  of which loss layer",
    ]
    rows_shown = [(c, rows, e) for c, by_rows in memory.estimates.items() for rows, e in by_rows.items()]
    rows_shown += [(False, rows, e) for rows, e in memory.chunked.items()]
    for checkpointing, rows, e in rows_shown:
        full, gradients = e.state.get("gradients", 0), format_bytes(e.gradients)
        if e.gradients < full:  # not all written yet at the peak
            gradients = f"{gradients if e.gradients else 'none yet'} of {format_bytes(full)}"
        fit = "" if memory.usable is None else ("  fits" if e.peak <= memory.usable else "  too big")
        loss = getattr(e, "loss_layer", 0)
        share = f"{format_bytes(loss)} ({loss / e.peak:.0%})" if loss and e.peak else "-"
        lines.append(
            f"{rows:>16}  {'yes' if checkpointing else 'no':>13}  {getattr(e, 'cross_entropy', '?'):>10}  "
            f"{format_bytes(e.peak):>10}  {e.peak_phase:<9}  {format_bytes(e.parameters):>11}  {gradients:<20}  "
            f"{format_bytes(e.optimizer_state):>10}  {format_bytes(e.activations):>11}  {share:>19}{fit}"
        )
    phases = dict.fromkeys(e.peak_phase for _, _, e in rows_shown)
    lines += [f"Peak in {'the optimizer step' if p == 'optimizer' else p}: {PEAK_NOTES.get(p, '')}" for p in phases]
    lines.append(
        "Loss layer: the LM head and cross-entropy; full: [tokens, vocab] logits, their fp32 upcast and gradient; "
        "chunked: one chunk of them at a time, over the trained tokens only (cross_entropy=chunked)."
    )
    return lines + ([memory.advice] if memory.advice else [])
