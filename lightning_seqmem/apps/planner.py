"""Plan a run before training: padding waste per strategy and max_length, and peak memory per micro_batch_size.

The data half (here) reads document lengths only, through the DataModule's own split pipeline
(``datamodule.pipeline.split_documents``), and asks the strategy objects the DataModule itself holds, built from the
same ``BatchingSettings`` with only the strategy and ``max_length`` varied: ``row_lengths``, ``split_sampler``,
``epoch_stats`` and ``largest_shape``. So token efficiency, tokens lost, rows, batches and the largest batch shape
are what ``SeqMemDataModule.stats()`` and ``max_batch_shape()`` report on the same data, by construction.
The memory half (``plan_memory.py``) traces training steps on fake tensors. No Lightning import.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from lightning_seqmem.apps.plan_lengths import Conversations, lengths_at, stream_sample, whole_lengths
from lightning_seqmem.apps.plan_memory import (
    DEFAULT_MARGIN,
    PEAK_NOTES,
    MemoryPlan,
    memory_table,
    parse_bytes,
    plan_memory,
)
from lightning_seqmem.batching.pair_strategies import PREFERENCE, make_split_strategy
from lightning_seqmem.batching.settings import BatchingSettings
from lightning_seqmem.batching.strategies import PLANNER_STRATEGIES as STRATEGIES
from lightning_seqmem.batching.strategies import Strategy, largest_shape, planner_name
from lightning_seqmem.batching.truncation import MIN_MAX_LENGTH, count_truncated, valid_max_length
from lightning_seqmem.datamodule.pipeline import split_documents

PERCENTILES = (50, 90, 95, 99, 100)
PAIR_UNPLANNED = ("pack_wrapped",)  # pairs and conversations are packed whole (best fit): wrapped would split them
MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "labels")  # what a memory trace hands the model
PLANNED_KINDS = ("text", "conversations", PREFERENCE)


def check_text(kind: str, detail: str = "") -> None:
    """Refuse data the planner cannot plan yet (``detail``: where to look instead)."""
    if kind not in PLANNED_KINDS:
        raise ValueError(
            f"seqmem-plan plans text datasets, conversations and preference pairs; prompt/completion "
            f"data is not supported yet{detail}."
        )


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
    if not values or not all(valid_max_length(v) for v in values):
        raise ValueError(
            f"max_lengths must be a non-empty list of ints >= {MIN_MAX_LENGTH}, got {list(values)[:8]}; "
            "e.g. [512, 1024, 2048]."
        )
    return tuple(sorted(set(values)))


def length_distribution(lengths: np.ndarray, max_lengths: Sequence[int]) -> dict[str, Any]:
    """Percentiles of ``[documents]`` token counts and the share of documents and tokens over each max_length."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = max(int(lengths.sum()), 1)
    return {
        "documents": int(lengths.size),
        "tokens": int(lengths.sum()),
        "mean": float(lengths.mean()) if lengths.size else 0.0,
        "percentiles": {p: int(np.percentile(lengths, p, method="higher")) if lengths.size else 0 for p in PERCENTILES},
        "over": {
            m: {
                "documents": float((lengths > m).mean()) if lengths.size else 0.0,
                "tokens": count_truncated(lengths, m) / total,
            }
            for m in max_lengths
        },
    }


def _strategy(strategy: str, max_length: int, settings: BatchingSettings, kind: str = "text") -> Strategy:
    """The train strategy a ``SeqMemDataModule`` with ``settings``, this strategy and ``max_length`` would hold
    for data of ``kind`` (one strategy for both splits, as the planner's rows compare strategies)."""
    varied = replace(settings, max_length=max_length, eval_strategy=None, **STRATEGIES[strategy])
    return make_split_strategy(varied, "train", kind)


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
    trained_share: float | None = None  # conversations: tokens that carry loss / tokens fed to the model

    @property
    def lost_share(self) -> float:
        return self.tokens_lost / max(self.tokens, 1)


def plan_strategy(
    lengths: Mapping[str, np.ndarray],
    strategy: str,
    max_length: int,
    settings: BatchingSettings = BatchingSettings(),
    devices: int = 1,
    accumulate_grad_batches: int = 1,
    kind: str = "text",
) -> StrategyPlan:
    """What ``SeqMemDataModule`` would measure with ``strategy`` and ``max_length`` on documents of ``lengths``.

    Args:
        lengths: split name -> ``[documents]`` token counts (empty documents already left out), with ``"train"``;
            or :class:`Conversations`.
        strategy: a key of :data:`STRATEGIES`.
        max_length: row capacity.
        settings: the DataModule's batching settings (``dm.settings.batching``): all but strategy and max_length.
        devices: data-parallel processes (optimizer steps count each rank's batches).
        accumulate_grad_batches: micro-batches per optimizer step.
        kind: ``"text"``, or ``"preference"``: then ``lengths`` are ``[pairs, 3]`` prompt/chosen/rejected counts
            (conversations: given as :class:`Conversations`, the kind follows).
    """
    check_strategies([strategy])
    check_max_lengths([max_length])
    if "train" not in lengths:
        raise ValueError(f"lengths needs a 'train' split, got {sorted(lengths)}.")
    kind = "conversations" if isinstance(lengths["train"], Conversations) else kind
    batcher, largest = _strategy(strategy, max_length, settings, kind), []
    for split, docs in lengths.items():
        train = split == "train"
        kept, lost, trained = lengths_at(docs, max_length)
        rows, cut = batcher.row_lengths(kept)
        epoch = batcher.epoch_stats(rows, batcher.split_sampler(rows, "train" if train else split, 1, 0))
        largest += [epoch.largest] if epoch.largest is not None else []
        if train:
            per_rank = len(batcher.split_sampler(rows, "train", devices, 0))
            counts = dict(
                epoch.counts(),
                tokens=cut.get("tokens", int(whole_lengths(docs).sum())),
                tokens_lost=lost + cut["tokens_truncated"] + cut.get("tokens_dropped", 0),
                optimizer_steps=math.ceil(per_rank / accumulate_grad_batches),
                trained_share=None if trained is None else trained / max(int(rows.sum()), 1),
            )
    return StrategyPlan(
        strategy=strategy, max_length=max_length, max_batch_shape=largest_shape([batcher], largest), **counts
    )


def plan_strategies(
    lengths, strategies, max_lengths, settings=BatchingSettings(), devices=1, accumulate_grad_batches=1, kind="text"
) -> list[StrategyPlan]:
    """:func:`plan_strategy` for every strategy x max_length."""
    return [
        plan_strategy(lengths, s, m, settings, devices, accumulate_grad_batches, kind)
        for s in check_strategies(strategies)
        for m in check_max_lengths(max_lengths)
    ]


def recommend_data(plans: Sequence[StrategyPlan], max_length: int | None = None) -> tuple[StrategyPlan, str]:
    """The plan that loses the fewest tokens, then wastes the fewest slots (to 1%), then has the max_length
    closest to ``max_length`` (the configured one: packing is ~100% efficient at any length, and shorter rows cut
    more documents); ties go to the earlier strategy (``pack_bfd`` keeps documents whole, ``pack_wrapped`` not)."""
    target = max_length or max(p.max_length for p in plans)
    best = min(
        plans, key=lambda p: (p.tokens_lost, -round(p.token_efficiency, 2), abs(math.log2(p.max_length / target)))
    )
    lost = "no token lost" if best.tokens_lost == 0 else f"{best.lost_share:.2%} of tokens lost (the least of all)"
    return best, (
        f"strategy={best.strategy} max_length={best.max_length}: {lost}, "
        f"{best.token_efficiency:.1%} of the slots hold real tokens"
    )


# ------------------------------------------------------------------------------------------------------ report
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


def recommend(
    plans: Sequence[StrategyPlan], memory: MemoryPlan | None, micro_batch_size: int, max_length: int | None = None
) -> tuple[dict, str]:
    """``({strategy, max_length, micro_batch_size, gradient_checkpointing}, one-line reason)``."""
    best, reason = recommend_data(plans, max_length)
    choice = {
        "strategy": best.strategy,
        "max_length": best.max_length,
        "micro_batch_size": micro_batch_size,
        "gradient_checkpointing": False,
    }
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


def format_plan(plan: RunPlan) -> str:
    """The report as text tables."""
    d = plan.distribution
    pct = "  ".join(f"p{p}={v}" for p, v in d["percentiles"].items())
    lines = [
        f"Train documents: {d['documents']:,}, {d['tokens']:,} tokens, mean {d['mean']:.1f} tokens; {pct}",
        "max_length | documents longer | tokens beyond it",
    ]
    lines += [f"{m:>10} | {o['documents']:>16.2%} | {o['tokens']:>16.2%}" for m, o in d["over"].items()]
    chat = any(s.trained_share is not None for s in plan.strategies)  # conversations: the trained share too
    lines += [
        "",
        "strategy           max_length  efficiency"
        + ("     trained" if chat else "")
        + "        tokens lost     rows  batches   steps  largest batch",
    ]
    for s in plan.strategies:
        mark = (
            " <- config"
            if plan.configured is not None
            and (s.strategy, s.max_length) == (plan.configured.strategy, plan.configured.max_length)
            else ""
        )
        trained = f"  {s.trained_share:>10.1%}" if chat else ""
        lines.append(
            f"{s.strategy:<18} {s.max_length:>10}  {s.token_efficiency:>10.1%}{trained}  {s.tokens_lost:>9,} "
            f"({s.lost_share:>5.1%}) {s.rows:>8,} {s.batches:>8,} {s.optimizer_steps:>7,}  "
            f"{s.max_batch_shape[0]} x {s.max_batch_shape[1]}{mark}"
        )
    lines += ["", *memory_table(plan.memory)] if plan.memory is not None else []
    lines += [
        "",
        "Recommended: " + " ".join(f"{k}={v}" for k, v in plan.recommended.items()),
        "Why: " + plan.recommendation,
    ]
    return "\n".join(lines)


def _with_config(plans: Sequence[StrategyPlan], strategy: str, max_length: int) -> StrategyPlan | None:
    return next((p for p in plans if (p.strategy, p.max_length) == (strategy, max_length)), None)


def build_plan(
    lengths: Mapping[str, np.ndarray],
    strategies: Sequence[str],
    max_lengths: Sequence[int],
    settings: BatchingSettings,
    configured: tuple[str, int],
    estimate: Callable[[int, int, bool], Any] | None = None,
    micro_batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    budget: int | None = None,
    margin: float = DEFAULT_MARGIN,
    devices: int = 1,
    accumulate_grad_batches: int = 1,
    kind: str = "text",
) -> RunPlan:
    """The whole plan from document lengths (``estimate`` ``None``: data half only); preference pairs
    (``kind="preference"``): ``[pairs, 3]`` lengths, and ``estimate`` takes a micro_batch_size in pairs."""
    strategies, max_lengths = check_strategies(strategies), check_max_lengths(max_lengths)
    config_strategy, config_length = configured
    plans = plan_strategies(lengths, strategies, max_lengths, settings, devices, accumulate_grad_batches, kind)
    current = _with_config(plans, config_strategy, config_length) or plan_strategy(
        lengths, config_strategy, config_length, settings, devices, accumulate_grad_batches, kind
    )
    memory = None
    if estimate is not None:
        memory = plan_memory(estimate, current.max_batch_shape[1], micro_batch_sizes, budget, margin, max_lengths)
    recommended, reason = recommend(plans, memory, settings.micro_batch_size, config_length)
    best = _with_config(plans, recommended["strategy"], recommended["max_length"])
    if memory is not None and best is not None and best.max_batch_shape[1] != memory.length and budget is not None:
        # The recommended rows are longer or shorter than the configured run's: size its micro-batch on its own.
        other = plan_memory(estimate, best.max_batch_shape[1], micro_batch_sizes, budget, margin, max_lengths)
        recommended, reason = recommend(plans, other, settings.micro_batch_size, config_length)
    train = whole_lengths(lengths["train"])
    if kind == PREFERENCE:  # the distribution of sequences (prompt + chosen, prompt + rejected), as max_length cuts
        train = (train[:, :1] + train[:, 1:]).reshape(-1)
    return RunPlan(
        distribution=length_distribution(train, max_lengths),
        strategies=plans,
        configured=current,
        memory=memory,
        recommendation=reason,
        recommended=recommended,
        train_lengths=train,
    )


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
    reference_copy: bool = False,
) -> RunPlan:
    """Plan the run of ``datamodule`` (a ``SeqMemDataModule``, not set up) with a model of ``model_config``.

    Args:
        datamodule: its tokenizer, strategy, max_length and batch settings are what is planned (a stream: on its
            first 20,000 documents, ``plan_lengths.stream_sample``).
        model_config: a ``transformers`` config (``training.building.build_model_config``); ``None`` plans the data only.
        strategies: keys of :data:`STRATEGIES` to compare.
        max_lengths: candidates; ``None`` = :func:`default_max_lengths` of the DataModule's.
        micro_batch_sizes: candidates for the memory table.
        gpu_memory: device memory to fit (``"80GiB"`` or bytes); ``None`` = no fitting.
        margin: share of ``gpu_memory`` kept back for the allocator.
        precision, device, attn_implementation: as in ``memory.estimate.estimate_training_memory``.
        devices, accumulate_grad_batches: for optimizer steps per epoch.
        reference_copy: the model keeps a frozen copy of its weights (``DPO(reference="copy")``): added to memory.

    Example::

        from lightning_seqmem.training.building import build_model_config
        dm = SeqMemDataModule(max_length=2048, strategy="pack")
        print(format_plan(plan(dm, build_model_config("tiny_llama", len(dm.tokenizer), 0), gpu_memory="24GiB")))
    """
    from lightning_seqmem.memory.estimate import estimate_training_memory, with_reference

    dm = stream_sample(datamodule)[0]  # a stream: planned on its first documents
    settings = dm.settings.batching
    kind = dm.tokenized_documents()[1].name
    configured = (planner_name(settings), settings.max_length)
    max_lengths = default_max_lengths(settings.max_length) if max_lengths is None else list(max_lengths)
    if kind in ("conversations", PREFERENCE):  # packed whole only (``BatchingSettings.check_kind``, pair strategies)
        strategies = [s for s in strategies if s not in PAIR_UNPLANNED]
    if kind == PREFERENCE:  # a max_length must leave room after the prompt
        max_lengths = [m for m in max_lengths if m > (settings.max_prompt_length or 0)] or [settings.max_length]
    estimate = None
    if model_config is not None:  # (micro_batch_size, length, checkpointing) -> MemoryEstimate
        keys = [k for k in dm.batch_keys() if k in MODEL_KEYS]  # pair bookkeeping keys cost next to nothing
        # Rows per micro_batch_size: 2 for padded pairs (chosen and rejected rows), else 1 (documents, packed rows).
        per = (
            _strategy(configured[0], settings.max_length, settings, kind).rows_per_batch("train")
            // settings.micro_batch_size
        )

        def estimate(rows: int, length: int, checkpointing: bool):
            est = estimate_training_memory(
                model_config, per * rows, length, keys, precision, device, attn_implementation, checkpointing
            )
            return with_reference(est) if reference_copy else est

    budget = parse_bytes(gpu_memory) if gpu_memory is not None else None
    return build_plan(
        datamodule_lengths(dm),
        strategies,
        max_lengths,
        settings,
        configured,
        estimate,
        micro_batch_sizes,
        budget,
        margin,
        devices,
        accumulate_grad_batches,
        kind,
    )


def datamodule_lengths(dm: Any) -> dict[str, np.ndarray]:
    """Per split, the token count of every non-empty document, as ``SeqMemDataModule(...)`` sees them: through
    its tokenize-once cache (which the training run then reuses) or pre-tokenized, from Arrow offsets only;
    conversations as :class:`Conversations` (cut per candidate ``max_length``), preference pairs as ``[pairs, 3]``
    prompt/chosen/rejected counts."""
    tokenized, data_kind = dm.tokenized_documents()
    kind = data_kind.name
    check_text(kind)
    if kind in ("conversations", PREFERENCE):
        documents = split_documents(tokenized, data_kind, dm.settings.batching.seed)
        if kind == "conversations":
            return {
                split: Conversations(docs.dataset, dm.settings.conversation.on_empty_labels)
                for split, docs in documents.items()
            }
        # [pairs, 3]: prompt, chosen, rejected (an empty prompt is a valid pair)
        return {
            split: np.stack([docs.parts[p].lengths for p in ("prompt", "chosen", "rejected")], axis=1)
            for split, docs in documents.items()
        }
    return {split: parts["documents"] for split, parts in _split_lengths(dm).items()}


def column_lengths(dm: Any, split: str = "train") -> dict[str, np.ndarray]:
    """Non-empty token counts of one split per part: ``documents`` for text, ``prompt`` and ``completion`` for
    prompt/completion data (what the length histogram draws, one panel each)."""
    return _split_lengths(dm)[split]


def _split_lengths(dm: Any) -> dict[str, dict[str, np.ndarray]]:
    """``{split: {part: token counts}}`` of the documents the DataModule's split pipeline keeps (non-empty, the
    validation split carved out as ``setup`` carves it); a part's empty entries are left out too."""
    tokenized, kind = dm.tokenized_documents()
    documents = split_documents(tokenized, kind, dm.settings.batching.seed)
    return {
        split: {part: source.lengths[source.lengths > 0] for part, source in docs.parts.items()}
        for split, docs in documents.items()
    }


__all__ = [
    "DEFAULT_MARGIN",
    "PEAK_NOTES",
    "PLANNED_KINDS",
    "STRATEGIES",
    "Conversations",
    "MemoryPlan",
    "RunPlan",
    "StrategyPlan",
    "build_plan",
    "check_text",
    "column_lengths",
    "datamodule_lengths",
    "default_max_lengths",
    "format_plan",
    "length_distribution",
    "memory_table",
    "parse_bytes",
    "plan",
    "plan_memory",
    "plan_strategies",
    "plan_strategy",
    "recommend",
    "recommend_data",
]
