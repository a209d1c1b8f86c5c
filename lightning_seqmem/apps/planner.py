"""Plan a run before training: padding waste per strategy and max_length, and peak memory per micro_batch_size.

The data half reads document lengths only (the ``length`` column that tokenization writes) and asks the strategy
objects the DataModule itself holds (``strategies.make_strategy``): ``plan_lengths``, ``split_sampler``,
``epoch_stats`` and ``largest_shape``. So token efficiency, tokens lost, rows, batches and the largest batch shape
are what ``SeqMemDataModule.stats()`` and ``max_batch_shape()`` report on the same data, by construction.
The memory half traces training steps on fake tensors (``memory/estimate.py``). No Lightning import.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_seqmem.memory.estimate import largest_fitting
from lightning_seqmem.batching.strategies import BatchingOptions, PadStrategy, largest_shape, make_strategy
from lightning_seqmem.batching.truncation import count_truncated

# Planner strategy names -> the SeqMemDataModule arguments that select them.
STRATEGIES: dict[str, dict[str, Any]] = {
    "pad": {"strategy": "pad", "pad_to_max_length": False},
    "pad_to_max_length": {"strategy": "pad", "pad_to_max_length": True},
    "truncate": {"strategy": "truncate"},
    "pack_bfd": {"strategy": "pack", "packing": "bfd"},
    "pack_wrapped": {"strategy": "pack", "packing": "wrapped"},
}
PERCENTILES = (50, 90, 95, 99, 100)
DEFAULT_MARGIN = 0.10  # of the budget, held back for the caching allocator's fragmentation and the CUDA context


def check_strategies(strategies: Sequence[str]) -> tuple[str, ...]:
    """Raise a ``ValueError`` naming the choices for an empty list or an unknown strategy."""
    strategies = tuple(strategies)
    unknown = [s for s in strategies if s not in STRATEGIES]
    if not strategies or unknown:
        raise ValueError(f"Unknown or no strategies {unknown[:5] or '[]'}; choose from {list(STRATEGIES)}.")
    return strategies


def check_max_lengths(max_lengths: Sequence[int]) -> tuple[int, ...]:
    """Raise a ``ValueError`` for an empty list or a ``max_length`` below 2 (a row needs an input and a target)."""
    values = tuple(max_lengths)
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 2]
    if not values or bad:
        raise ValueError(
            f"max_lengths must be a non-empty list of ints >= 2, got {list(values)[:8]}; e.g. [512, 1024, 2048]."
        )
    return tuple(sorted(set(values)))


def strategy_name(strategy: str, packing: str = "bfd", pad_to_max_length: bool = False) -> str:
    """The planner's name for a DataModule configuration (``strategy="pack", packing="bfd"`` -> ``"pack_bfd"``)."""
    if strategy == "pack":
        return f"pack_{packing}"
    if strategy == "pad" and pad_to_max_length:
        return "pad_to_max_length"
    return strategy


def parse_bytes(value: str | int | float) -> int:
    """``"80GiB"``, ``"80 GB"``, ``"512MiB"`` or a number of bytes -> bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]i?B|B)?\s*", str(value), flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"Cannot read a memory size from {str(value)[:40]!r}; write e.g. 80GiB, 40GB or 512MiB.")
    units = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    return int(float(match.group(1)) * units[(match.group(2) or "B").lower()])


# --------------------------------------------------------------------------------------------------- data half
@dataclass(frozen=True)
class DataSettings:
    """The DataModule arguments the numbers depend on (besides strategy and max_length)."""

    micro_batch_size: int = 8
    eval_batch_size: int | None = None
    pad_to_multiple_of: int | None = 8
    seed: int = 42
    overflow: str = "split"
    group_by_length: bool = False
    max_tokens_per_batch: int | None = None
    drop_last: bool = False

    @classmethod
    def from_datamodule(cls, dm: Any) -> DataSettings:
        """Read the settings from a ``SeqMemDataModule`` (or anything with the same attributes)."""
        values = {name: getattr(dm, name) for name in cls.__dataclass_fields__}
        if values["overflow"] is None:  # the DataModule's default: split plain text (prompt/completion truncates)
            values["overflow"] = "split"
        return cls(**values)


def length_distribution(lengths: np.ndarray, max_lengths: Sequence[int]) -> dict[str, Any]:
    """Percentiles of ``[documents]`` token counts and the share of documents and tokens over each max_length."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = max(int(lengths.sum()), 1)
    return {
        "documents": int(lengths.size),
        "tokens": int(lengths.sum()),
        "mean": float(lengths.mean()) if lengths.size else 0.0,
        "percentiles": {p: int(np.percentile(lengths, p, method="higher")) if lengths.size else 0
                        for p in PERCENTILES},
        "over": {m: {"documents": float((lengths > m).mean()) if lengths.size else 0.0,
                     "tokens": count_truncated(lengths, m) / total} for m in max_lengths},
    }


def _strategy(strategy: str, max_length: int, settings: DataSettings) -> PadStrategy:
    """The strategy object a ``SeqMemDataModule`` with these settings would hold."""
    args = STRATEGIES[strategy]
    return make_strategy(args["strategy"], BatchingOptions(
        max_length, settings.pad_to_multiple_of, args.get("pad_to_max_length", False),
        group_by_length=settings.group_by_length, max_tokens_per_batch=settings.max_tokens_per_batch,
        packing=args.get("packing", "bfd"), overflow=settings.overflow))


@dataclass(frozen=True)
class StrategyPlan:
    """One strategy at one max_length, on the train split (``max_batch_shape`` over train and validation)."""

    strategy: str
    max_length: int
    token_efficiency: float  # real tokens / slots fed to the model in one epoch
    tokens: int  # tokens of the train documents
    tokens_lost: int  # truncated or dropped: never reach the model
    rows: int  # rows per epoch (documents, or packed rows)
    batches: int  # micro-batches per epoch, one process
    optimizer_steps: int  # per epoch, per the devices and accumulate_grad_batches given
    max_batch_shape: tuple[int, int]  # (rows, length), the largest batch of any split
    rows_dropped_per_epoch: int = 0

    @property
    def lost_share(self) -> float:
        return self.tokens_lost / max(self.tokens, 1)


def plan_strategy(
    lengths: Mapping[str, np.ndarray],
    strategy: str,
    max_length: int,
    settings: DataSettings = DataSettings(),
    devices: int = 1,
    accumulate_grad_batches: int = 1,
) -> StrategyPlan:
    """What ``SeqMemDataModule`` would measure with ``strategy`` and ``max_length`` on documents of ``lengths``.

    Args:
        lengths: split name -> ``[documents]`` token counts (empty documents already left out), with ``"train"``.
        strategy: a key of :data:`STRATEGIES`.
        max_length: row capacity.
        settings: the other DataModule arguments.
        devices: data-parallel processes (optimizer steps count each rank's batches).
        accumulate_grad_batches: micro-batches per optimizer step.
    """
    check_strategies([strategy])
    check_max_lengths([max_length])
    if "train" not in lengths:
        raise ValueError(f"lengths needs a 'train' split, got {sorted(lengths)}.")
    batcher, largest = _strategy(strategy, max_length, settings), []
    for split, docs in lengths.items():
        train = split == "train"
        rows, cut = batcher.plan_lengths(np.asarray(docs, dtype=np.int64))
        batch_size = settings.micro_batch_size if train else (settings.eval_batch_size or settings.micro_batch_size)
        epoch = batcher.epoch_stats(rows, batcher.split_sampler(rows, batch_size, train, settings.seed,
                                                                settings.drop_last, 1, 0))
        largest += [epoch.largest] if epoch.largest is not None else []
        if train:
            per_rank = len(batcher.split_sampler(rows, batch_size, True, settings.seed, settings.drop_last, devices, 0))
            counts = dict(epoch.counts(), tokens=int(np.asarray(docs).sum()),
                          tokens_lost=cut["tokens_truncated"] + cut.get("tokens_dropped", 0),
                          optimizer_steps=math.ceil(per_rank / accumulate_grad_batches))
    return StrategyPlan(strategy=strategy, max_length=max_length, max_batch_shape=largest_shape([batcher], largest),
                        **counts)


def plan_strategies(lengths, strategies, max_lengths, settings=DataSettings(), devices=1,
                    accumulate_grad_batches=1) -> list[StrategyPlan]:
    """:func:`plan_strategy` for every strategy x max_length."""
    return [plan_strategy(lengths, s, m, settings, devices, accumulate_grad_batches)
            for s in check_strategies(strategies) for m in check_max_lengths(max_lengths)]


def recommend_data(plans: Sequence[StrategyPlan], max_length: int | None = None) -> tuple[StrategyPlan, str]:
    """The plan that loses the fewest tokens, then wastes the fewest slots (to 1%), then has the max_length
    closest to ``max_length`` (the configured one: packing is ~100% efficient at any length, and shorter rows cut
    more documents); ties go to the earlier strategy (``pack_bfd`` keeps documents whole, ``pack_wrapped`` not)."""
    target = max_length or max(p.max_length for p in plans)
    best = min(plans, key=lambda p: (p.tokens_lost, -round(p.token_efficiency, 2), abs(math.log2(p.max_length / target))))
    lost = "no token lost" if best.tokens_lost == 0 else f"{best.lost_share:.2%} of tokens lost (the least of all)"
    return best, (f"strategy={best.strategy} max_length={best.max_length}: {lost}, "
                  f"{best.token_efficiency:.1%} of the slots hold real tokens")


# ------------------------------------------------------------------------------------------------- memory half
@dataclass
class MemoryPlan:
    """Predicted peak memory per micro_batch_size at one worst-case length, with and without checkpointing."""

    length: int
    budget: int | None
    margin: float
    estimates: dict[bool, dict[int, Any]] = field(default_factory=dict)  # checkpointing -> rows -> MemoryEstimate
    fits: dict[bool, int | None] = field(default_factory=dict)  # checkpointing -> largest rows within budget
    advice: str = ""

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
        estimate: ``(rows, length, gradient_checkpointing) -> MemoryEstimate``.
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
        fits, out.estimates[checkpointing] = largest_fitting(lambda rows: estimate(rows, length, checkpointing),
                                                             limit, sizes)
        out.fits[checkpointing] = fits if out.usable is not None else None
    if out.usable is not None and out.fits[False] is None:
        out.advice = _no_fit_advice(estimate, out, shorter_lengths)
    return out


def _no_fit_advice(estimate, memory: MemoryPlan, shorter_lengths: Sequence[int]) -> str:
    from lightning_seqmem.memory.stats import format_bytes

    one = memory.estimates[False][min(memory.estimates[False])]
    ways = []
    if memory.fits[True] is not None:
        ways.append(f"gradient checkpointing (model.gradient_checkpointing=true) fits micro_batch_size="
                    f"{memory.fits[True]}")
    for length in sorted((m for m in shorter_lengths if m < memory.length), reverse=True):
        if estimate(1, length, False).peak <= memory.usable:
            ways.append(f"data.max_length={length} fits micro_batch_size=1")
            break
    ways = ways or ["a smaller model, bf16 weights (trainer.precision=bf16-true) or a bigger device"]
    return (f"No micro_batch_size fits {format_bytes(memory.budget)} ({format_bytes(memory.usable)} usable after a "
            f"{memory.margin:.0%} allocator margin) at length {memory.length}: one row needs {format_bytes(one.peak)}. "
            "What would fit: " + "; ".join(ways) + ".")


# ------------------------------------------------------------------------------------------------------ report
@dataclass
class Plan:
    """Everything ``seqmem-plan`` prints."""

    distribution: dict[str, Any]
    strategies: list[StrategyPlan]
    configured: StrategyPlan | None
    memory: MemoryPlan | None
    recommendation: str
    recommended: dict[str, Any]
    train_lengths: np.ndarray = field(default=None, repr=False)  # [documents], for the histogram


def recommend(plans: Sequence[StrategyPlan], memory: MemoryPlan | None, micro_batch_size: int,
              max_length: int | None = None) -> tuple[dict, str]:
    """``({strategy, max_length, micro_batch_size, gradient_checkpointing}, one-line reason)``."""
    best, reason = recommend_data(plans, max_length)
    choice = {"strategy": best.strategy, "max_length": best.max_length, "micro_batch_size": micro_batch_size,
              "gradient_checkpointing": False}
    if memory is not None and memory.usable is not None:
        if memory.fits[False] is not None:
            choice["micro_batch_size"] = memory.fits[False]
            reason += f"; micro_batch_size={memory.fits[False]} is the largest that fits"
        elif memory.fits[True] is not None:
            choice.update(micro_batch_size=memory.fits[True], gradient_checkpointing=True)
            reason += f"; only gradient checkpointing fits, with micro_batch_size={memory.fits[True]}"
        else:
            choice["micro_batch_size"] = None
            reason += "; but nothing fits the memory budget (see above)"
    return choice, reason


def format_plan(plan: Plan) -> str:
    """The report as text tables."""
    d = plan.distribution
    pct = "  ".join(f"p{p}={v}" for p, v in d["percentiles"].items())
    lines = [f"Train documents: {d['documents']:,}, {d['tokens']:,} tokens, mean {d['mean']:.1f} tokens; {pct}",
             "max_length | documents longer | tokens beyond it"]
    lines += [f"{m:>10} | {o['documents']:>16.2%} | {o['tokens']:>16.2%}" for m, o in d["over"].items()]
    lines += ["", "strategy           max_length  efficiency        tokens lost     rows  batches   steps  largest batch"]
    for s in plan.strategies:
        mark = " <- config" if plan.configured is not None and (s.strategy, s.max_length) == (
            plan.configured.strategy, plan.configured.max_length) else ""
        lines.append(f"{s.strategy:<18} {s.max_length:>10}  {s.token_efficiency:>10.1%}  {s.tokens_lost:>9,} "
                     f"({s.lost_share:>5.1%}) {s.rows:>8,} {s.batches:>8,} {s.optimizer_steps:>7,}  "
                     f"{s.max_batch_shape[0]} x {s.max_batch_shape[1]}{mark}")
    lines += ["", *memory_table(plan.memory)] if plan.memory is not None else []
    lines += ["", "Recommended: " + " ".join(f"{k}={v}" for k, v in plan.recommended.items()),
              "Why: " + plan.recommendation]
    return "\n".join(lines)


# What is live at a peak in each phase of the traced step (forward, zero_grad, backward, optimizer step).
PEAK_NOTES = {
    "forward": "the previous step's gradients are still alive (zero_grad frees them after the forward).",
    "backward": "the forward's saved activations are alive and this step's gradients are not all written yet "
                "('none yet of X': zero_grad freed the previous ones); they come later, below the peak.",
    "optimizer": "parameters, gradients and AdamW state are all alive, with the optimizer step's temporaries.",
}


def memory_table(memory: MemoryPlan) -> list[str]:
    """The memory table's lines: per micro_batch_size, the peak, the phase it falls in and what is live then."""
    from lightning_seqmem.memory.stats import format_bytes

    lines = [f"Peak training memory at length {memory.length} (worst case of the configured run)" + (
                 f"; budget {format_bytes(memory.budget)}, {format_bytes(memory.usable)} usable after a "
                 f"{memory.margin:.0%} allocator margin" if memory.budget else ""),
             f"{'':>56}{' live at the peak ':-^58}",
             "micro_batch_size  checkpointing        peak  falls in    parameters  gradients             "
             "   optimizer  activations"]
    for checkpointing, by_rows in memory.estimates.items():
        for rows, e in by_rows.items():
            full, gradients = e.state.get("gradients", 0), format_bytes(e.gradients)
            if e.gradients < full:  # not all written yet at the peak
                gradients = f"{gradients if e.gradients else 'none yet'} of {format_bytes(full)}"
            fit = "" if memory.usable is None else ("  fits" if e.peak <= memory.usable else "  too big")
            lines.append(f"{rows:>16}  {'yes' if checkpointing else 'no':>13}  {format_bytes(e.peak):>10}  "
                         f"{e.peak_phase:<9}  {format_bytes(e.parameters):>11}  {gradients:<20}  "
                         f"{format_bytes(e.optimizer_state):>10}  {format_bytes(e.activations):>11}{fit}")
    phases = dict.fromkeys(e.peak_phase for by_rows in memory.estimates.values() for e in by_rows.values())
    lines += [f"Peak in {'the optimizer step' if p == 'optimizer' else p}: {PEAK_NOTES.get(p, '')}" for p in phases]
    return lines + ([memory.advice] if memory.advice else [])


def _with_config(plans: Sequence[StrategyPlan], strategy: str, max_length: int) -> StrategyPlan | None:
    return next((p for p in plans if (p.strategy, p.max_length) == (strategy, max_length)), None)


def build_plan(
    lengths: Mapping[str, np.ndarray],
    strategies: Sequence[str],
    max_lengths: Sequence[int],
    settings: DataSettings,
    configured: tuple[str, int],
    estimate: Callable[[int, int, bool], Any] | None = None,
    micro_batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    budget: int | None = None,
    margin: float = DEFAULT_MARGIN,
    devices: int = 1,
    accumulate_grad_batches: int = 1,
) -> Plan:
    """The whole plan from document lengths (``estimate`` ``None``: data half only)."""
    strategies, max_lengths = check_strategies(strategies), check_max_lengths(max_lengths)
    config_strategy, config_length = configured
    plans = plan_strategies(lengths, strategies, max_lengths, settings, devices, accumulate_grad_batches)
    current = _with_config(plans, config_strategy, config_length) or plan_strategy(
        lengths, config_strategy, config_length, settings, devices, accumulate_grad_batches)
    memory = None
    if estimate is not None:
        memory = plan_memory(estimate, current.max_batch_shape[1], micro_batch_sizes, budget, margin, max_lengths)
    recommended, reason = recommend(plans, memory, settings.micro_batch_size, config_length)
    best = _with_config(plans, recommended["strategy"], recommended["max_length"])
    if memory is not None and best is not None and best.max_batch_shape[1] != memory.length and budget is not None:
        # The recommended rows are longer or shorter than the configured run's: size its micro-batch on its own.
        other = plan_memory(estimate, best.max_batch_shape[1], micro_batch_sizes, budget, margin, max_lengths)
        recommended, reason = recommend(plans, other, settings.micro_batch_size, config_length)
    return Plan(distribution=length_distribution(lengths["train"], max_lengths), strategies=plans,
                configured=current, memory=memory, recommendation=reason, recommended=recommended,
                train_lengths=np.asarray(lengths["train"]))


def default_max_lengths(max_length: int) -> list[int]:
    """Candidates around the configured ``max_length``: a quarter, a half, itself and double."""
    return sorted({m for m in (max_length // 4, max_length // 2, max_length, 2 * max_length) if m >= 2})


def plan(
    datamodule: Any,
    model_config: Any = None,
    strategies: Sequence[str] = tuple(STRATEGIES),
    max_lengths: Sequence[int] | None = None,
    micro_batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    gpu_memory: str | int | None = None,
    margin: float = DEFAULT_MARGIN,
    precision: str = "bf16-mixed",
    device: str = "cuda",
    attn_implementation: str = "sdpa",
    devices: int = 1,
    accumulate_grad_batches: int = 1,
) -> Plan:
    """Plan the run of ``datamodule`` (a ``SeqMemDataModule``, not set up) with a model of ``model_config``.

    Args:
        datamodule: its tokenizer, strategy, max_length and batch settings are what is planned.
        model_config: a ``transformers`` config (``model.build_model_config``); ``None`` plans the data only.
        strategies: keys of :data:`STRATEGIES` to compare.
        max_lengths: candidates; ``None`` = :func:`default_max_lengths` of the DataModule's.
        micro_batch_sizes: candidates for the memory table.
        gpu_memory: device memory to fit (``"80GiB"`` or bytes); ``None`` = no fitting.
        margin: share of ``gpu_memory`` kept back for the allocator.
        precision, device, attn_implementation: as in ``memory.estimate.estimate_training_memory``.
        devices, accumulate_grad_batches: for optimizer steps per epoch.

    Example::

        from lightning_seqmem.training.model import build_model_config
        dm = SeqMemDataModule(max_length=2048, strategy="pack")
        print(format_plan(plan(dm, build_model_config("tiny_llama", len(dm.tokenizer), 0), gpu_memory="24GiB")))
    """
    from lightning_seqmem.memory.estimate import estimate_training_memory

    dm = datamodule
    configured = (strategy_name(dm.strategy, dm.packing, dm.pad_to_max_length), dm.max_length)
    max_lengths = default_max_lengths(dm.max_length) if max_lengths is None else list(max_lengths)
    estimate = None
    if model_config is not None:
        keys = dm.batch_keys()

        def estimate(rows: int, length: int, checkpointing: bool):
            return estimate_training_memory(model_config, rows, length, keys, precision, device, attn_implementation,
                                            checkpointing)

    budget = parse_bytes(gpu_memory) if gpu_memory is not None else None
    return build_plan(datamodule_lengths(dm), strategies, max_lengths, DataSettings.from_datamodule(dm), configured,
                      estimate, micro_batch_sizes, budget, margin, devices, accumulate_grad_batches)


def datamodule_lengths(dm: Any) -> dict[str, np.ndarray]:
    """Per split, the token count of every non-empty document, as ``SeqMemDataModule(...)`` sees them: through
    its tokenize-once cache (which the training run then reuses) or pre-tokenized, from Arrow offsets only."""
    if dm.tokenized_documents()[1] != "text":
        raise ValueError("seqmem-plan plans text datasets; prompt/completion data is not supported yet.")
    return {split: parts["documents"] for split, parts in _split_lengths(dm).items()}


def column_lengths(dm: Any, split: str = "train") -> dict[str, np.ndarray]:
    """Non-empty token counts of one split per part: ``documents`` for text, ``prompt`` and ``completion`` for
    prompt/completion data (what the length histogram draws, one panel each)."""
    return _split_lengths(dm)[split]


def _split_lengths(dm: Any) -> dict[str, dict[str, np.ndarray]]:
    """``{split: {part: non-empty token counts}}`` for train and validation, the validation split carved out once."""
    from lightning_seqmem.data.sources import ensure_validation_split
    from lightning_seqmem.data.tokens import view_of_dataset

    tokenized, kind = dm.tokenized_documents()
    tokenized = ensure_validation_split(tokenized, seed=dm.seed)
    parts = {"documents": "input_ids"} if kind == "text" else {"prompt": "prompt_ids", "completion": "completion_ids"}
    out = {}
    for split in ("train", "validation"):
        out[split] = {}
        for name, column in parts.items():
            lengths = view_of_dataset(tokenized[split], column).lengths  # through a carved-out split's indices
            out[split][name] = lengths[lengths > 0]
    return out


__all__ = ["STRATEGIES", "DataSettings", "MemoryPlan", "Plan", "StrategyPlan", "build_plan", "column_lengths",
           "datamodule_lengths", "default_max_lengths", "format_plan", "length_distribution", "memory_table",
           "parse_bytes", "plan", "plan_memory", "plan_strategies", "plan_strategy", "recommend", "recommend_data",
           "strategy_name"]
