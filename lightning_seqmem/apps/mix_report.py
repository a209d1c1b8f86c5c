"""A ``Mix`` as ``seqmem-train`` reports it: each source's share at the start, and in the summary what the run read.

Weights are normalised (``prose: 0.7`` beside ``chat: 0.5`` is 58 % prose), so the line at the start says the
shares the run trains on, and which source loses tokens to ``max_length``. The summary's per-source figures are of
the run: a share of the real tokens trained (the mix keeps every source within one row of its share at every batch),
and the passes over the source that makes, rather than the planned epoch ``stats()`` describes.
"""

from __future__ import annotations

from typing import Any

__all__ = ["source_rows", "start_line"]

LOSS_WORTH_SAYING = 0.05  # a source losing this share of its tokens or more to max_length is named at the start


def _sources(dm: Any) -> tuple[tuple[str, ...], dict[str, dict[str, Any]]]:
    names = tuple(dm.source_names()) if hasattr(dm, "source_names") else ()
    if len(names) < 2:
        return (), {}
    try:
        train = dm.stats().get("train", {})
    except Exception:  # not set up (a DDP rank sets up in fit): the weights alone
        train = {}
    return names, train.get("sources", {}) or {}


def start_line(dm: Any) -> str | None:
    """One line naming each source's share of what the run trains on (``None`` for one dataset), and the sources
    that lose a twentieth or more of their tokens to ``max_length``."""
    names, sources = _sources(dm)
    if not names:
        return None
    mix = getattr(dm, "dataset", None)
    by = getattr(mix, "by", "tokens")
    weights = dict(zip(getattr(mix, "names", ()), getattr(mix, "weights", ())))
    parts, losses = [], []
    for name in names:
        source = sources.get(name, {})
        share = source.get("share", weights.get(name, source.get("weight")))
        parts.append(f"{name} {100 * share:.1f} %" if share is not None else name)
        tokens, cut = source.get("tokens"), source.get("tokens_truncated")
        if tokens and cut and cut / tokens >= LOSS_WORTH_SAYING:
            losses.append(f"{name} loses {100 * cut / tokens:.0f} % of its tokens to truncation")
    line = f"mix of {len(names)} sources, shares of the {by} trained: {', '.join(parts)}"
    if losses:
        length = getattr(dm, "max_length", None)
        line += f"; at max_length={length} {', '.join(losses)} (a larger data.max_length keeps more)"
    return line


def source_rows(source: dict[str, Any], real_tokens_trained: int | None) -> dict[str, Any]:
    """A source's rows of the run summary: its share, the tokens the run read of it and the passes over it that
    makes (map-style: from the epoch's plan and the tokens trained), else what a stream counted as read; what a
    source does not answer is left out."""
    rows: dict[str, Any] = {}
    share = source.get("share", source.get("weight"))
    if share is not None:
        rows["share"] = share
    planned, passes = source.get("tokens_read"), source.get("passes")
    if planned is not None and share is not None and real_tokens_trained is not None:  # map-style: the epoch's plan
        read = round(share * real_tokens_trained)
        rows["tokens_read"] = read
        if passes:
            rows["passes_read"] = read / (planned / passes)
    elif source.get("tokens") is not None:  # a stream: its counts are of what was read
        rows["tokens_read"] = source["tokens"]
    for key in ("documents", "tokens_truncated", "tokens_dropped", "token_efficiency_in_mix"):
        if source.get(key) is not None:
            rows[key if key == "token_efficiency_in_mix" or planned is None else f"{key}_per_pass"] = source[key]
    return rows
