"""What ``seqmem-plan`` plans a ``Mix`` on.

Sources of one data kind: one map-style copy of the DataModule whose documents are the mix's (``mix_sample``). Each
source is tokenized as the training run tokenizes it (the same cache), then its training documents are taken as often
as the mix reads them in an epoch: by its weight against its size (``by``: tokens or documents), whole passes plus a
seeded part of one, until every source is read once (``exhausted="repeat"``) or the first runs out (``"stop"``).

Sources of different kinds that share a batch layout (text, conversations, prompt/completion; ``data=mix``): each
source is planned by its own kind (its own cuts at each ``max_length``, ``mix_lengths``), and every candidate's
training rows are interleaved by the run's own ``MixedBatchSampler`` (``plan_mixed_strategy``), so efficiency, tokens
lost, batches and the worst batch are the mixed epoch's. Each source's own length distribution is given beside the
mix's. No Lightning import.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from lightning_seqmem.apps.plan_lengths import MixLengths, MixSource, lengths_at, whole_lengths
from lightning_seqmem.batching.packed_rows import pack_lengths
from lightning_seqmem.batching.strategies import Strategy, largest_shape
from lightning_seqmem.kinds.base import Kind, epoch_stats
from lightning_seqmem.mixing.sampler import MixedBatchSampler, mixed_sampler, row_tokens
from lightning_seqmem.mixing.spec import Mix


def source_datamodules(dm: Any) -> list[tuple[str, float, Any]]:
    """``(name, weight, a DataModule of that source alone with dm's settings)`` per source of ``dm``'s ``Mix``."""
    out = []
    for source in dm.dataset.sources:
        settings = dict(dm.hparams, streaming=False)
        if source.text_column is not None:
            settings["text_column"] = source.text_column
        alone = type(dm)(dataset=source.dataset, tokenizer=dm._tokenizer_arg, **settings)
        out.append((source.name, dm.dataset.weight(source.name), alone))
    return out


def _takes(units: list[int], counts: list[int], weights: list[float], exhausted: str) -> list[float]:
    """How many times over each source is read in an epoch (``repeat``: every source once, ``stop``: until the
    first runs out)."""
    needed = [u / w for u, w in zip(units, weights) if w > 0]  # the total at which each source is read once
    total = max(needed) if exhausted == "repeat" else min(needed)
    return [w * total / u if w > 0 and u else 0.0 for u, w in zip(units, weights)]


def source_kinds(dm: Any) -> list[tuple[str, float, Any, Kind]]:
    """``(name, weight, the source's DataModule alone, its data kind)`` per source, read from the columns before
    any source is tokenized.

    Raises:
        ValueError: sources whose batches have other layouts (preference pairs beside other kinds), named.
    """
    from lightning_seqmem.data.sources import load_text_dataset
    from lightning_seqmem.kinds.detect import detect_dataset

    out = [
        (name, weight, alone, detect_dataset(load_text_dataset(alone.dataset), alone.settings.data.text_column))
        for name, weight, alone in source_datamodules(dm)
    ]
    if any(k.sequences != out[0][3].sequences for *_, k in out):
        found = ", ".join(f"{n!r}: {k.name}" for n, _, _, k in out)
        raise ValueError(
            f"seqmem-plan cannot plan this Mix: its sources hold {found}, whose batches have other layouts. Text, "
            "prompt/completion and conversations mix; preference pairs mix only with preference pairs."
        )
    return out


def one_kind(sources: list[tuple[str, float, Any, Kind]]) -> bool:
    return all(k == sources[0][3] for *_, k in sources)


def _epoch_index(rng: np.random.Generator, unit: np.ndarray, times: float) -> np.ndarray:
    """The documents of a source an epoch reads ``times`` over: whole passes, then a seeded prefix of a
    permutation holding its share of the ``[documents]`` units."""
    n, passes = len(unit), math.floor(times + 1e-9)  # 0.999... (weights x sizes in floating point) is one pass
    order = rng.permutation(n)
    part = int(np.searchsorted(np.cumsum(unit[order]), max(times - passes, 0.0) * unit.sum(), side="right"))
    return np.concatenate([np.tile(np.arange(n), passes), order[:part]]).astype(np.int64)


def _summary(name: str, weight: float, lengths: np.ndarray) -> str:
    p50, p99 = (int(np.percentile(lengths, p, method="higher")) if len(lengths) else 0 for p in (50, 99))
    return (
        f"mix source {name!r} (weight {weight:.3g}): {len(lengths):,} documents, {int(lengths.sum()):,} tokens, "
        f"median {p50:,}, p99 {p99:,} tokens"
    )


def mix_sample(dm: Any) -> tuple[Any, list[str]]:
    """``(a map-style copy of dm over the mix's documents, notes)``, or ``(dm, [])`` when ``dm`` reads no ``Mix`` or
    a ``Mix`` of several kinds (planned per source: :func:`mix_lengths`).

    Raises:
        ValueError: sources whose batches have other layouts (``source_kinds``).
    """
    import datasets

    from lightning_seqmem.data.sources import ensure_validation_split

    if not isinstance(dm.dataset, Mix):
        return dm, []
    mix, seed = dm.dataset, dm.settings.batching.seed
    sources = source_kinds(dm)
    if not one_kind(sources):
        return dm, []
    parts, units, counts, notes = [], [], [], []
    for name, weight, alone, _ in sources:
        tokenized, kind = alone.tokenized_documents()
        splits = ensure_validation_split(tokenized, seed=seed)
        lengths = kind.documents(splits["train"]).lengths
        parts.append((name, splits, kind, lengths if mix.by == "tokens" else np.ones(len(lengths), np.int64)))
        units.append(int(lengths.sum()) if mix.by == "tokens" else len(lengths))
        counts.append(len(splits["train"]))
        notes.append(_summary(name, weight, lengths))
    times = _takes(units, counts, list(mix.weights), mix.exhausted)
    rng = np.random.default_rng(seed)
    train, validation = [], []
    for (name, splits, _, unit), t in zip(parts, times):
        train.append(splits["train"].select(_epoch_index(rng, unit, t)))
        validation.append(splits["validation"])
        notes.append(f"mix source {name!r} read {t:.2f} times over in an epoch ({mix.by}, exhausted={mix.exhausted!r})")
    columns = set.intersection(*(set(ds.column_names) for ds in train + validation))
    keep = lambda ds: ds.select_columns(sorted(columns))  # noqa: E731
    mixed = datasets.DatasetDict(
        train=datasets.concatenate_datasets([keep(ds) for ds in train]),
        validation=datasets.concatenate_datasets([keep(ds) for ds in validation]),
    )
    copy = type(dm)(dataset=mixed, tokenizer=dm._tokenizer_arg, **dict(dm.hparams, streaming=False))
    copy._documents = (mixed, parts[0][2])  # already tokenized, of the sources' kind
    return copy, notes


def mix_lengths(dm: Any) -> dict[str, MixLengths] | None:
    """Per split, a ``Mix`` of several data kinds as the planner plans it (``plan_lengths.MixLengths``: each source
    tokenized through the run's cache and read by its own kind), or ``None`` when ``dm`` reads no ``Mix`` or one of
    a single kind (``mix_sample`` plans it).

    Raises:
        ValueError: sources of other batch layouts (preference pairs beside other kinds), named.
    """
    from lightning_seqmem.datamodule.pipeline import split_documents

    if not isinstance(dm.dataset, Mix):
        return None
    sources = source_kinds(dm)
    if one_kind(sources):
        return None
    mix, settings = dm.dataset, dm.settings.batching
    planned = []
    for name, weight, alone, _ in sources:
        tokenized, kind = alone.tokenized_documents()
        docs = split_documents(tokenized, kind, settings.seed)  # the validation split carved out as setup does
        planned.append((name, weight, kind, {split: kind.plan_lengths(d, alone.settings) for split, d in docs.items()}))
    whole = [k.sequence_lengths(whole_lengths(p["train"])) for _, _, k, p in planned]
    units = [w if mix.by == "tokens" else np.ones(len(w), np.int64) for w in whole]
    # The passes the run makes: its sampler weighs the rows it trains on, each source cut at the run's max_length
    # (a conversation keeps at most max_length tokens), not the documents whole.
    kept = [_kept(p["train"], dm.max_length, w) for (_, _, _, p), w in zip(planned, whole)]
    kept = [k if mix.by == "tokens" else np.ones(len(k), np.int64) for k in kept]
    times = _takes([int(k.sum()) for k in kept], [len(k) for k in kept], list(mix.weights), mix.exhausted)
    rng = np.random.default_rng(settings.seed)
    read = [w[_epoch_index(rng, u, t)] for w, u, t in zip(whole, units, times)]
    seed = settings.seed if mix.seed is None else mix.seed
    out = {}
    for split in planned[0][3]:
        train = split == "train"
        parts = tuple(
            MixSource(name, weight, kind, p[split], kind.sequence_lengths(whole_lengths(p[split])), t if train else 1.0)
            for (name, weight, kind, p), t in zip(planned, times)
        )
        joined = np.concatenate(read if train else [s.whole for s in parts])
        out[split] = MixLengths(parts, joined, mix.by, mix.exhausted, seed)
    return out


def plan_mixed_strategy(
    lengths: Mapping[str, MixLengths],
    strategy_for: Callable[[Kind], Strategy],
    max_length: int,
    devices: int = 1,
    accumulate_grad_batches: int = 1,
) -> dict[str, Any]:
    """One candidate of a mix of several kinds: each source cut and batched by ``strategy_for(its kind)`` (the
    strategy a DataModule of that batching and ``max_length`` holds), its training rows interleaved by the run's
    ``MixedBatchSampler`` and batched by the first source's strategy (as ``MixMode`` does); validation batches one
    source each. Returns ``StrategyPlan``'s counts and ``max_batch_shape``: the largest of the mixed epoch's batches,
    of every source's batches alone (a batch of the mix can hold any source's longest rows) and of their validation
    batches. Tokens and tokens lost are each source's times the passes the epoch reads of it."""
    train = lengths["train"]
    strategies = [strategy_for(s.kind) for s in train.sources]
    rows, units, largest, lost = [], [], [], []
    cuts = [lengths_at(s.lengths, max_length, t) for s, t in zip(train.sources, strategies)]  # by each kind
    for strategy, (kept, kind_lost, _) in zip(strategies, cuts):
        r, cut = strategy.row_lengths(kept)
        rows.append(r)
        units.append(_units(train.by, strategy, kept, r))
        lost.append(kind_lost + cut["tokens_truncated"] + cut.get("tokens_dropped", 0))
        largest += [epoch_stats(strategy, r, "train").largest] if len(r) else []
    empty = [s.name for s, r in zip(train.sources, rows) if s.weight > 0 and not len(r)]
    if empty:  # the DataModule refuses such a mix (``MixMode``): say so for this candidate
        raise ValueError(
            f"Mix source {empty[0]!r} gives no training row at max_length={max_length} (every document dropped): "
            "plan longer max_lengths (plan.max_lengths=[...]), or give it weight 0."
        )
    for split, mix in lengths.items():  # validation: each source's own batches
        for source, strategy in zip(mix.sources, strategies) if split != "train" else ():
            r, _ = strategy.row_lengths(lengths_at(source.lengths, max_length, strategy)[0])
            largest += [epoch_stats(strategy, r, split).largest] if len(r) else []
    samplers = [_sampler(train, units, rows, strategies[0], n) for n in sorted({1, devices})]  # one process; ranks
    epoch = strategies[0].epoch_stats(np.concatenate(rows), samplers[0])
    passes = [c["passes"] for c in samplers[0].source_counts(0)]
    fed = [p * int(r.sum()) for p, r in zip(passes, rows)]
    trained = [f if t is None else p * t for p, f, (_, _, t) in zip(passes, fed, cuts)]  # text: every token
    chat = any(cut[2] is not None for cut in cuts)
    return dict(
        epoch.counts(),
        rows=int(sum(c["rows"] for c in samplers[0].source_counts(0))),  # rows read, as MixMode.stats() counts
        tokens=round(sum(p * float(whole_lengths(s.lengths).sum()) for p, s in zip(passes, train.sources))),
        tokens_lost=round(sum(p * n for p, n in zip(passes, lost))),
        optimizer_steps=math.ceil(len(samplers[-1]) / accumulate_grad_batches),
        trained_share=sum(trained) / max(sum(fed), 1) if chat else None,
        max_batch_shape=largest_shape(strategies, [epoch.largest, *largest] if epoch.largest else largest),
    )


def _kept(docs: Any, max_length: int, whole: np.ndarray) -> np.ndarray:
    """A source's training lengths as the run's rows hold them at ``max_length``: conversations cut by their
    oldest turns; text (split into rows, nothing lost) and prompt/completion rows (cut by limits of the
    candidate's strategy) as they are."""
    from lightning_seqmem.batching.conversation_rows import ConversationLengths

    return (
        np.asarray(lengths_at(docs, max_length)[0], dtype=np.int64) if isinstance(docs, ConversationLengths) else whole
    )


def _units(by: str, strategy: Strategy, kept: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """What a weight counts in each training row (``MixMode._units``): its tokens, or its documents (the pieces a
    packed row holds)."""
    if by == "tokens":
        return row_tokens(rows)
    if strategy.packs:
        s = strategy.settings
        packed = pack_lengths(kept, s.max_length, strategy.options.method, strategy.overflow)
        return np.diff(packed.seg_row_offsets).astype(np.int64)
    return np.ones(len(rows), dtype=np.int64)


def _sampler(mix: MixLengths, units, rows, strategy: Strategy, devices: int) -> MixedBatchSampler:
    """Rank 0's mixed training sampler, built as ``MixMode.sampler`` builds it."""
    weights = [source.weight for source in mix.sources]
    return mixed_sampler(weights, units, rows, mix.exhausted, strategy, seed=mix.seed, num_replicas=devices, rank=0)


__all__ = ["mix_lengths", "mix_sample", "plan_mixed_strategy", "source_datamodules", "source_kinds"]
