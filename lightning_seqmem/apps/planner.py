"""Plan a run before training: padding waste per strategy and max_length, and peak memory per micro_batch_size.

The data half (here) reads document lengths only, through the DataModule's own split pipeline
(``datamodule.pipeline.split_documents``), and asks the strategy objects the DataModule itself holds, built from the
same ``BatchingSettings`` with only the batching options (``Pad(...)``, ``Truncate()``, ``Pack(...)``, compared as
objects) and ``max_length`` varied: ``row_lengths``, ``split_sampler``, ``epoch_stats`` and ``largest_shape``. So
token efficiency, tokens lost, rows, batches and the largest batch shape are what ``SeqMemDataModule.stats()`` and
``max_batch_shape()`` report on the same data, by construction. The memory half (``plan_memory.py``) traces
training steps on fake tensors; the report and the recommendation are ``plan_report.py``. No Lightning import.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from lightning_seqmem.apps.plan_lengths import MixLengths, lengths_at, stream_sample, whole_lengths
from lightning_seqmem.apps.plan_memory import (
    DEFAULT_MARGIN,
    PEAK_NOTES,
    MemoryPlan,
    memory_table,
    parse_bytes,
    plan_memory,
)
from lightning_seqmem.apps.plan_mix import mix_lengths, mix_sample, plan_mixed_strategy
from lightning_seqmem.apps.plan_report import (
    RunPlan,
    StrategyPlan,
    format_plan,
    recommend,
    recommend_data,
)
from lightning_seqmem.batching.options import Batching, Pack, Pad, Truncate, as_batching
from lightning_seqmem.batching.settings import BatchingSettings
from lightning_seqmem.batching.strategies import Strategy, largest_shape
from lightning_seqmem.batching.truncation import MIN_MAX_LENGTH, count_truncated, valid_max_length
from lightning_seqmem.datamodule.pipeline import split_documents
from lightning_seqmem.kinds.base import Kind
from lightning_seqmem.kinds.text import Text

PERCENTILES = (50, 90, 95, 99, 100)
STRATEGIES: tuple[Batching, ...] = (
    Pad(),
    Pad(to_max_length=True),
    Truncate(),
    Pack(method="bfd"),
    Pack(method="wrapped"),
)
"""The batchings compared by default (``conf/plan.yaml``'s ``plan.strategies``); the configured one joins them at its
max_length."""
MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "labels")  # what a memory trace hands the model
TEXT = Text()


def check_text(kind: Kind, detail: str = "") -> None:
    """Refuse data the planner cannot plan yet (``Kind.planned``; ``detail``: where to look instead)."""
    if not kind.planned:
        raise ValueError(
            f"seqmem-plan plans text datasets, conversations and preference pairs; prompt/completion "
            f"data is not supported yet{detail}."
        )


def check_strategies(strategies: Sequence[Batching | str]) -> tuple[Batching, ...]:
    """The batchings to compare, as objects (a name of ``options.NAMES``, ``"pack_wrapped"``, is its object); a
    ``ValueError`` for an empty list or an unknown name."""
    if not strategies:
        raise ValueError(f"No strategies to plan; give batching names, e.g. {[s.spelling for s in STRATEGIES]}.")
    return tuple(dict.fromkeys(as_batching(s, "strategy") for s in strategies))


def wraps_documents(batching: Batching) -> bool:
    """Kinds packed whole (``Kind.trains_whole``: pairs, conversations) leave these out: ``Pack(method="wrapped")``
    would split their items."""
    return isinstance(batching, Pack) and batching.method == "wrapped"


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


def _strategy(batching: Batching, max_length: int, settings: BatchingSettings, kind: Kind = TEXT) -> Strategy:
    """The train strategy a ``SeqMemDataModule`` with ``settings``, this ``batching`` and ``max_length`` would hold
    for data of ``kind`` (one batching for both splits, as the planner's rows compare batchings)."""
    varied = replace(settings, max_length=max_length, batching=batching, eval_batching=None)
    return kind.strategy(varied, "train")


def plan_strategy(
    lengths: Mapping[str, np.ndarray],
    strategy: Batching | str,
    max_length: int,
    settings: BatchingSettings = BatchingSettings(),
    devices: int = 1,
    accumulate_grad_batches: int = 1,
    kind: Kind = TEXT,
) -> StrategyPlan:
    """What ``SeqMemDataModule`` would measure with batching ``strategy`` and ``max_length`` on documents of
    ``lengths``.

    Args:
        lengths: split name -> what ``kind.plan_lengths`` gives (``[documents]`` token counts, empty documents
            already left out; ``[pairs, 3]`` prompt/chosen/rejected counts; ``ConversationLengths``), with
            ``"train"``.
        strategy: the batching options (``Pad(...)``, ``Truncate()``, ``Pack(...)``, or a name: ``"pack_wrapped"``).
        max_length: row capacity.
        settings: the DataModule's batching settings (``dm.settings.batching``): all but batching and max_length.
        devices: data-parallel processes (optimizer steps count each rank's batches).
        accumulate_grad_batches: micro-batches per optimizer step.
        kind: the data kind (``kinds``; the DataModule's ``tokenized_documents()[1]``): it builds the strategy.
    """
    (strategy,) = check_strategies([strategy])
    check_max_lengths([max_length])
    if "train" not in lengths:
        raise ValueError(f"lengths needs a 'train' split, got {sorted(lengths)}.")
    if isinstance(lengths["train"], MixLengths):  # sources of several kinds: each cut by its own, rows mixed
        mixed = plan_mixed_strategy(
            lengths,
            lambda k: _strategy(strategy, max_length, settings, k),
            max_length,
            devices,
            accumulate_grad_batches,
        )
        return StrategyPlan(strategy=strategy.spelling, max_length=max_length, batching=strategy, **mixed)
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
        strategy=strategy.spelling,
        max_length=max_length,
        max_batch_shape=largest_shape([batcher], largest),
        batching=strategy,
        **counts,
    )


def plan_strategies(
    lengths, strategies, max_lengths, settings=BatchingSettings(), devices=1, accumulate_grad_batches=1, kind=TEXT
) -> list[StrategyPlan]:
    """:func:`plan_strategy` for every batching x max_length."""
    return [
        plan_strategy(lengths, s, m, settings, devices, accumulate_grad_batches, kind)
        for s in check_strategies(strategies)
        for m in check_max_lengths(max_lengths)
    ]


def build_plan(
    lengths: Mapping[str, np.ndarray],
    strategies: Sequence[Batching | str],
    max_lengths: Sequence[int],
    settings: BatchingSettings,
    configured: tuple[Batching, int],
    estimate: Callable[[int, int, bool], Any] | None = None,
    micro_batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    budget: int | None = None,
    margin: float = DEFAULT_MARGIN,
    devices: int = 1,
    accumulate_grad_batches: int = 1,
    kind: Kind = TEXT,
    shorter_advice: bool = True,
) -> RunPlan:
    """The whole plan from the lengths ``kind.plan_lengths`` gives (``estimate`` ``None``: data half only); for
    preference pairs ``estimate`` takes a micro_batch_size in pairs.
    ``configured``: the DataModule's ``(batching, max_length)``, added to the rows when no candidate equals it and
    its max_length is planned. ``shorter_advice``: when nothing fits, trace shorter max_lengths for the advice
    (``False`` when the fit search follows, which estimates what fits and says so)."""
    strategies, max_lengths = check_strategies(strategies), check_max_lengths(max_lengths)
    config_length = configured[1]
    plans = plan_strategies(lengths, strategies, max_lengths, settings, devices, accumulate_grad_batches, kind)
    listed = next((p for p in plans if (p.batching, p.max_length) == tuple(configured)), None)
    current = listed or plan_strategy(lengths, *configured, settings, devices, accumulate_grad_batches, kind)
    if listed is None and config_length in max_lengths:  # the configured options beside the candidates
        plans.append(current)
    memory = None
    if estimate is not None:
        shorter = max_lengths if shorter_advice else ()
        memory = plan_memory(estimate, current.max_batch_shape[1], micro_batch_sizes, budget, margin, shorter)
    recommended, reason = recommend(plans, memory, settings.micro_batch_size, config_length)
    best = next(p for p in plans if (p.strategy, p.max_length) == (recommended["strategy"], recommended["max_length"]))
    if memory is not None and best.max_batch_shape[1] != memory.length and budget is not None:
        # The recommended rows are longer or shorter than the configured run's: size its micro-batch on its own.
        other = plan_memory(estimate, best.max_batch_shape[1], micro_batch_sizes, budget, margin, shorter)
        recommended, reason = recommend(plans, other, settings.micro_batch_size, config_length)
    train = kind.sequence_lengths(whole_lengths(lengths["train"]))  # the distribution max_length cuts
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
    strategies: Sequence[Batching | str] = STRATEGIES,
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
    cross_entropy: str = "auto",
    lora: Any = None,
    optimizer: str = "adamw",
    shorter_advice: bool = True,
) -> RunPlan:
    """Plan the run of ``datamodule`` (a ``SeqMemDataModule``, not set up) with a model of ``model_config``.

    Args:
        datamodule: its tokenizer, batching, max_length and batch settings are what is planned (a stream: on its
            first 20,000 documents, ``plan_lengths.stream_sample``; a ``Mix``: as its epoch reads it, ``plan_mix``).
        model_config: a ``transformers`` config (``training.building.build_model_config``); ``None`` plans the data
            only.
        strategies: the batching options to compare (default :data:`STRATEGIES`); the DataModule's joins them.
        max_lengths: candidates; ``None`` = :func:`default_max_lengths` of the DataModule's.
        micro_batch_sizes: candidates for the memory table.
        gpu_memory: device memory to fit (``"80GiB"`` or bytes); ``None`` = no fitting.
        margin: share of ``gpu_memory`` kept back for the allocator.
        precision, device, attn_implementation: as in ``memory.estimate.estimate_training_memory``.
        devices, accumulate_grad_batches: for optimizer steps per epoch.
        reference_copy: the model keeps a frozen copy of its weights (``DPO(reference="copy")``): added to memory.
        cross_entropy: the model's loss layer (``CausalLM(cross_entropy=...)``); with the full one, the memory half
            also says when ``"chunked"`` would make a micro_batch_size fit.
        lora, optimizer: the model's adapter (``CausalLM(lora=...)``: LoRA, or QLoRA's 4-bit base) and optimizer
            (``"adamw"`` or ``"adamw_8bit"``), as the estimate traces them; with an adapter, DPO's reference is the
            base with the adapter off (no copy).
        shorter_advice: when no micro_batch_size fits, trace shorter max_lengths for the advice (``seqmem-plan``
            leaves it to its fit search).

    Example::

        from lightning_seqmem.training.building import build_model_config
        dm = SeqMemDataModule(max_length=2048, strategy="pack")
        print(format_plan(plan(dm, build_model_config("tiny_llama", len(dm.tokenizer), 0), gpu_memory="24GiB")))
    """
    from lightning_seqmem.memory.estimate import with_reference
    from lightning_seqmem.memory.layer_scaling import cached_scaled

    dm = stream_sample(datamodule)[0]  # a stream: its first documents
    mixed = mix_lengths(dm)  # a Mix of several kinds: each source planned by its own
    dm = mix_sample(dm)[0] if mixed is None else dm  # a Mix of one kind: its epoch's documents
    settings = dm.settings.batching
    kinds = [dm.tokenized_documents()[1]] if mixed is None else [s.kind for s in mixed["train"].sources]
    kind = kinds[0]  # a mix batches as its first source does (``MixMode``)
    configured = (settings.batching, settings.max_length)
    max_lengths = default_max_lengths(settings.max_length) if max_lengths is None else list(max_lengths)
    if any(k.trains_whole for k in kinds):  # packed whole only (``Kind.check``, pair strategies)
        strategies = [s for s in check_strategies(strategies) if not wraps_documents(s)]
    roomy = [m for m in max_lengths if all(k.leaves_room(settings, m) for k in kinds)]  # none: check_max_lengths
    max_lengths = roomy or max_lengths and [settings.max_length]
    estimate = None
    if model_config is not None:  # (micro_batch_size, length, checkpointing) -> MemoryEstimate
        batch_keys = dm.batch_keys() if mixed is None else kind.strategy(settings, "train").keys  # a mix's: its first
        keys = [k for k in batch_keys if k in MODEL_KEYS]  # pair bookkeeping keys cost next to nothing
        # Rows per micro_batch_size: 2 for padded pairs (chosen and rejected rows), else 1 (documents, packed rows).
        per = _strategy(*configured, settings, kind).rows_per_batch("train") // settings.micro_batch_size

        def estimate(rows: int, length: int, checkpointing: bool, cross_entropy: str = cross_entropy):
            est = cached_scaled(  # traced at 1 and 2 layers (layer_scaling), once per process: the fit search shares it
                model_config,
                per * rows,
                length,
                keys,
                precision,
                device,
                attn_implementation,
                checkpointing,
                cross_entropy=cross_entropy,
                lora=lora,
                optimizer=optimizer,
            )
            return with_reference(est) if reference_copy and lora is None else est

    budget = parse_bytes(gpu_memory) if gpu_memory is not None else None
    result = build_plan(
        datamodule_lengths(dm) if mixed is None else mixed,
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
        shorter_advice,
    )
    result.sources = [  # each source's own lengths beside the mix's (a Mix of several kinds)
        dict(name=s.name, kind=s.kind.name, weight=s.weight, times=s.times, lengths=s.whole)
        | length_distribution(s.whole, max_lengths)
        for s in (mixed["train"].sources if mixed is not None else ())
    ]
    return result


def datamodule_lengths(dm: Any) -> dict[str, np.ndarray]:
    """Per split, what the DataModule's data kind is planned on (``Kind.plan_lengths``), as ``SeqMemDataModule(...)``
    sees them: through its tokenize-once cache (which the training run then reuses) or pre-tokenized, from Arrow
    offsets only. Text: the token count of every non-empty document; conversations: ``ConversationLengths`` (cut
    per candidate ``max_length``); preference pairs: ``[pairs, 3]`` prompt/chosen/rejected counts."""
    tokenized, kind = dm.tokenized_documents()
    check_text(kind)
    documents = split_documents(tokenized, kind, dm.settings.batching.seed)
    return {split: kind.plan_lengths(docs, dm.settings) for split, docs in documents.items()}


__all__ = [
    "DEFAULT_MARGIN",
    "PEAK_NOTES",
    "STRATEGIES",
    "MemoryPlan",
    "RunPlan",
    "StrategyPlan",
    "build_plan",
    "check_text",
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
