"""A split's preference pairs as token views: checked and planned once on lengths, gathered when served.

:func:`plan_pairs` runs the checks of ``preference.check_pairs`` on a whole split without materialising its tokens:
the two truncation stages on the ``[rows]`` lengths (``preference_spans``), identical completions compared only
for pairs whose kept completions have equal lengths (gathered a block at a time), and pairs that lost a whole
completion left out (counted). The pairs served are numpy views of the Arrow columns (``tokens.TokenSource``): the
collators cut them with the same limits, so what they keep is exactly what was counted here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from lightning_seqmem.batch import REF_LOGPS_KEYS
from lightning_seqmem.batching.preference import (
    CHOSEN,
    REJECTED,
    PairSpans,
    PreferenceLimits,
    identical_completions,
    name_rows,
    preference_spans,
)

_COMPARE_BLOCK = 4096  # pairs whose completions are gathered at once for the identical-completion check


@dataclass(frozen=True)
class PairSource:
    """The pairs a split serves: ``prompt``, ``chosen`` and ``rejected`` token sources (untruncated views), the
    optional precomputed reference log-probabilities (``[pairs]`` float arrays) and the truncated
    ``[2, pairs]`` sequence lengths (what the model sees of each side)."""

    prompt: Any
    chosen: Any
    rejected: Any
    ref: dict[str, np.ndarray]
    sequence_lengths: np.ndarray  # [2, pairs]

    def __len__(self) -> int:
        return len(self.prompt)

    @property
    def pair_lengths(self) -> np.ndarray:
        """``[pairs]`` tokens of both truncated sequences: a packed row's item."""
        return self.sequence_lengths.sum(axis=0)

    def example(self, i: int) -> dict[str, Any]:
        """Pair ``i`` as the collators take it: ``{"prompt_ids", "chosen_ids", "rejected_ids"[, ref logps]}``."""
        out = {"prompt_ids": self.prompt.row(i), "chosen_ids": self.chosen.row(i), "rejected_ids": self.rejected.row(i)}
        return {**out, **{key: float(values[i]) for key, values in self.ref.items()}}


class PairRows(Dataset):
    """Row ``i`` is pair ``i`` (``PreferenceCollator`` takes a list of them)."""

    def __init__(self, source: PairSource) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.source.example(i)


class PackedPairRows(Dataset):
    """Row ``r`` is the list of pairs ``pairs[offsets[r] : offsets[r + 1]]`` (``PackedPairCollator`` takes a list
    of such rows)."""

    def __init__(self, source: PairSource, pairs: np.ndarray, offsets: np.ndarray) -> None:
        self.source, self.pairs, self.offsets = source, pairs, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, r: int) -> list[dict[str, Any]]:
        return [self.source.example(int(i)) for i in self.pairs[self.offsets[r] : self.offsets[r + 1]]]


def kept_identical(chosen: Any, rejected: Any, spans: PairSpans) -> np.ndarray:
    """``[pairs]`` bool: the kept chosen completion equals the kept rejected one (no preference signal).

    Only pairs of equal kept lengths are compared, ``_COMPARE_BLOCK`` pairs gathered at a time (bounded memory).
    """
    c_start, c_kept = spans.completion_start, spans.completion_kept
    candidates = np.flatnonzero((c_kept[CHOSEN] == c_kept[REJECTED]) & (c_kept[CHOSEN] > 0))
    out = np.zeros(c_kept.shape[1], dtype=bool)
    for first in range(0, len(candidates), _COMPARE_BLOCK):
        docs = candidates[first : first + _COMPARE_BLOCK]
        lengths = c_kept[CHOSEN, docs]
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        flat_c = chosen.gather(docs, c_start[CHOSEN, docs], lengths)
        flat_r = rejected.gather(docs, c_start[REJECTED, docs], lengths)
        out[docs] = identical_completions(flat_c, offsets, flat_r, offsets)
    return out


def check_ref_logps(ref: dict[str, np.ndarray]) -> None:
    """Refuse precomputed reference log-probabilities that are missing or not finite (NaN, inf): one of them makes
    the DPO loss, and then every weight, NaN.

    Raises:
        ValueError: naming the column, the rows and the fix.
    """
    for key, values in ref.items():
        bad = ~np.isfinite(np.asarray(values, dtype=np.float64))
        if bad.any():
            first = np.asarray(values, dtype=np.float64)[bad][0]
            raise ValueError(
                f"{name_rows(bad, 0)}: column {key!r} is {first} (missing or not finite); reference "
                "log-probabilities must be finite numbers (a NaN trains every weight to NaN). Recompute them for "
                "these rows, drop the rows, or drop the column and use DPO(reference='copy')."
            )


def plan_pairs(
    prompt: Any, chosen: Any, rejected: Any, ref: dict[str, np.ndarray], limits: PreferenceLimits
) -> tuple[PairSource, PairSpans, list[str]]:
    """Check and plan a split's pairs on lengths: ``(pairs kept, spans of all pairs, warnings)``.

    Args:
        prompt, chosen, rejected: token sources of the split's rows (``lengths``, ``gather``, ``select``, ``row``).
        ref: precomputed reference log-probabilities, ``[rows]`` each (may be empty).
        limits: the truncation limits.

    Raises:
        ValueError: an empty completion, a reference log-probability that is not finite, or
            (``on_overlong_prompt="error"``) a prompt longer than ``max_length`` on its own, naming the rows.
    """
    check_ref_logps(ref)
    spans = preference_spans(prompt.lengths, chosen.lengths, rejected.lengths, limits)
    spans = replace(spans, identical=kept_identical(chosen, rejected, spans))
    warnings = []
    if spans.identical.any():
        warnings.append(
            f"{int(spans.identical.sum())} pair(s) with chosen == rejected "
            f"({name_rows(spans.identical, 0)}): no preference signal in them (compared after "
            "truncation); they are kept and counted (rows_chosen_equals_rejected)."
        )
    keep = np.flatnonzero(~spans.lost)
    cut = spans.lost & ~spans.overlong
    if cut.any():
        warnings.append(
            f"{int(cut.sum())} pair(s) lose a whole completion to truncation "
            f"({name_rows(cut, 0)}) and are left out (rows_without_completion); raise max_length "
            "or lower max_prompt_length to keep them."
        )
    if spans.overlong.any():
        warnings.append(
            f"{int(spans.overlong.sum())} pair(s) have a prompt alone longer than max_length={limits.max_length} "
            f"({name_rows(spans.overlong, 0)}): they train nothing and are left out (pairs_dropped_overlong_prompt); "
            "set max_prompt_length below max_length to keep them with the prompt's end."
        )
    source = PairSource(
        prompt.select(keep),
        chosen.select(keep),
        rejected.select(keep),
        {key: np.asarray(values)[keep] for key, values in ref.items() if key in REF_LOGPS_KEYS},
        spans.sequence_lengths[:, keep],
    )
    return source, spans, warnings
