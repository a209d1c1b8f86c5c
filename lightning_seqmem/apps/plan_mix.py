"""What ``seqmem-plan`` plans a ``Mix`` on: one map-style copy of the DataModule whose documents are the mix's.

Each source is tokenized as the training run tokenizes it (the same cache), then its training documents are taken
as often as the mix reads them in an epoch: by its weight against its size (``by``: tokens or documents), whole
passes plus a seeded part of one, until every source is read once (``exhausted="repeat"``) or the first runs out
(``"stop"``). Lengths, efficiency, the worst batch and memory are then the mix's; each source's own length
distribution is given beside it. Sources of one data kind only (the planner plans one kind). No Lightning import.
"""

from __future__ import annotations

from typing import Any

import numpy as np

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


def mix_sample(dm: Any) -> tuple[Any, list[str]]:
    """``(a map-style copy of dm over the mix's documents, notes)``, or ``(dm, [])`` when ``dm`` reads no ``Mix``.

    Raises:
        ValueError: sources of different data kinds (named), which the planner cannot plan as one.
    """
    import datasets

    from lightning_seqmem.data.sources import ensure_validation_split, load_text_dataset
    from lightning_seqmem.kinds.detect import detect_dataset

    if not isinstance(dm.dataset, Mix):
        return dm, []
    mix, seed = dm.dataset, dm.settings.batching.seed
    alone_dms = source_datamodules(dm)
    kinds = [detect_dataset(load_text_dataset(a.dataset), a.settings.data.text_column) for _, _, a in alone_dms]
    if any(k != kinds[0] for k in kinds):  # before any source is tokenized
        found = ", ".join(f"{n!r}: {k.name}" for (n, *_), k in zip(alone_dms, kinds))
        raise ValueError(f"seqmem-plan plans a Mix of one data kind; its sources hold {found}. Plan them one by one.")
    parts, units, counts, notes = [], [], [], []
    for name, weight, alone in alone_dms:
        tokenized, kind = alone.tokenized_documents()
        splits = ensure_validation_split(tokenized, seed=seed)
        lengths = kind.documents(splits["train"]).lengths
        parts.append((name, splits, kind, lengths if mix.by == "tokens" else np.ones(len(lengths), np.int64)))
        units.append(int(lengths.sum()) if mix.by == "tokens" else len(lengths))
        counts.append(len(splits["train"]))
        p50, p99 = (int(np.percentile(lengths, p, method="higher")) if len(lengths) else 0 for p in (50, 99))
        notes.append(
            f"mix source {name!r} (weight {weight:.3g}): {len(lengths):,} documents, {int(lengths.sum()):,} tokens, "
            f"median {p50:,}, p99 {p99:,} tokens"
        )
    times = _takes(units, counts, list(mix.weights), mix.exhausted)
    rng = np.random.default_rng(seed)
    train, validation = [], []
    for (name, splits, _, unit), n, t in zip(parts, counts, times):
        order = rng.permutation(n)  # the part of a pass: a seeded prefix holding its share of the units
        part = int(np.searchsorted(np.cumsum(unit[order]), (t - int(t)) * unit.sum(), side="right"))
        index = np.concatenate([np.tile(np.arange(n), int(t)), order[:part]]).astype(np.int64)
        train.append(splits["train"].select(index))
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


__all__ = ["mix_sample", "source_datamodules"]
