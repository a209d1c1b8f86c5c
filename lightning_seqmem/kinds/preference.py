"""Preference pairs (``prompt``, ``chosen``, ``rejected``: text or conversations; or ``prompt_ids``,
``chosen_ids``, ``rejected_ids``): two sequences per item, prompt + chosen and prompt + rejected, truncated in TRL's
two stages (``batching.preference``) and planned over the whole split (``batching.pair_rows``), so a stream of them
is refused. Precomputed ``ref_chosen_logps``/``ref_rejected_logps`` columns come along."""

from __future__ import annotations

from typing import Any

import numpy as np

from lightning_seqmem.batch import REF_LOGPS_KEYS
from lightning_seqmem.batching.pair_rows import plan_pairs
from lightning_seqmem.batching.pair_strategies import make_pair_strategy
from lightning_seqmem.batching.strategies import Strategy
from lightning_seqmem.data.columns import PREFERENCE_IDS, PREFERENCE_TEXT
from lightning_seqmem.kinds.base import Documents, Kind, PreparedSplit, epoch_stats, lost_tokens
from lightning_seqmem.messages import short_repr


class Preference(Kind):
    """Preference pairs; ``chat``: the ``chat_pairs.ChatPairs`` of pairs of turn lists (``None``: text)."""

    name = "preference"
    parts = dict(zip(PREFERENCE_TEXT, PREFERENCE_IDS))
    sequences = 2
    streams = False
    stats_keys = (
        "prompt_tokens_truncated",
        "chosen_tokens_truncated",
        "rejected_tokens_truncated",
        "rows_without_completion",
        "rows_chosen_equals_rejected",
        "pairs_dropped_overlong_prompt",
    )
    trains_whole = True

    def __init__(self, pretokenized: bool = False, chat: Any = None) -> None:
        super().__init__(pretokenized)
        self.chat = chat

    def __hash__(self) -> int:
        return hash((type(self), self.pretokenized, self.chat))

    def source_columns(self, text_column: str = "text") -> list[str]:
        if self.pretokenized:
            return list(PREFERENCE_IDS)
        return self.chat.source_columns if self.chat is not None else list(PREFERENCE_TEXT)

    def cache_key(self, tokenizer: Any, conversation: Any = None) -> list[str]:
        return self.chat.cache_key(tokenizer) if self.chat is not None else []

    def text_encoder(self, tokenizer: Any, text_column: str, conversation: Any):
        from lightning_seqmem.data.encode import chat_pair_function, pair_function

        return chat_pair_function(tokenizer, self.chat) if self.chat is not None else pair_function(tokenizer)

    def carry_columns(self, raw: Any, tokenized: Any) -> Any:
        """The token cache keeps token columns only: the reference values come from the rows."""
        for split, ds in raw.items():
            for key in REF_LOGPS_KEYS:
                if key in ds.column_names:
                    tokenized[split] = tokenized[split].add_column(key, ds[key])
        return tokenized

    def strategy(self, batching: Any, split: str, plan_cache: str | None = None) -> Strategy:
        return make_pair_strategy(batching, split, plan_cache)

    def lost_tokens_fix(self, strategy: Strategy) -> str:
        return strategy.lost_tokens_fix(True)

    def plan_lengths(self, docs: Documents, settings: Any) -> np.ndarray:
        """``[pairs, 3]`` prompt, chosen and rejected token counts (an empty prompt is a valid pair)."""
        return np.stack([docs.parts[part].lengths for part in PREFERENCE_TEXT], axis=1)

    def sequence_lengths(self, lengths: Any) -> np.ndarray:
        """The pairs' sequences, prompt + chosen and prompt + rejected, as ``max_length`` cuts them."""
        lengths = np.asarray(lengths)
        return (lengths[:, :1] + lengths[:, 1:]).reshape(-1)

    def leaves_room(self, batching: Any, max_length: int) -> bool:
        """A completion needs room after a prompt of ``max_prompt_length`` (``PreferenceLimits`` refuses less)."""
        return max_length > (batching.max_prompt_length or 0)

    def kept_documents(self, lengths: np.ndarray) -> np.ndarray:
        return np.arange(len(lengths))  # never skipped quietly: an empty completion is an error naming the row

    def prepare(self, split: str, docs: Documents, strategy: Strategy, settings: Any) -> PreparedSplit:
        """Pairs checked and planned on lengths (``pair_rows.plan_pairs``: TRL's two truncation stages, identical
        completions, pairs without a completion left out), then batched by the split's pair strategy; every token
        that will not reach the model counted (a pair's prompt counts once per sequence: both rows carry it)."""
        prompt, chosen, rejected = (docs.parts[name] for name in PREFERENCE_TEXT)
        if split == "train" and len(prompt) == 0:
            raise ValueError("The training split holds no preference pairs: there is nothing to train on.")
        try:
            ref = reference_logps(docs.dataset)
            source, spans, warnings = plan_pairs(prompt, chosen, rejected, ref, strategy.pair_limits)
        except ValueError as error:
            raise ValueError(f"Preference data, split {split!r}: {error}") from None
        sequences = prompt.lengths + np.stack([chosen.lengths, rejected.lengths])  # [2, pairs] before truncation
        max_length = strategy.settings.max_length
        stats = {
            "documents": len(prompt),
            "empty_documents_skipped": 0,
            "tokens": int(sequences.sum()),
            **spans.dropped(),
            "tokens_dropped": int(spans.sequence_lengths[:, spans.lost].sum()),
            "documents_split": 0,
            "documents_over_max_length": int((sequences > max_length).any(axis=0).sum()),
            "longest_document": int(sequences.max(initial=0)),
        }
        planned = strategy.rows(source)
        stats.update(epoch_stats(strategy, planned.lengths, split).counts())
        warnings = [f"{split}: {message}" for message in warnings]
        warnings += lost_tokens(split, stats, strategy, max_length, self.lost_tokens_fix(strategy))
        return PreparedSplit(docs.dataset, planned.rows, planned.lengths, None, stats, warnings)


def reference_logps(dataset: Any) -> dict[str, np.ndarray]:
    """The precomputed reference log-probability columns a split holds, as ``[pairs]`` float64 arrays.

    One number per sequence, as TRL precomputes them: the reference model's log-probability of the whole
    completion (the sum over its tokens). A column of lists (per-token log-probabilities) or of text is refused here,
    by name, before it reaches collation; a missing value becomes NaN, which ``check_ref_logps`` names by row.

    Raises:
        ValueError: a reference column that is not one number per row, naming the column, a row and the fix.
    """
    import pyarrow as pa

    out = {}
    for key in REF_LOGPS_KEYS:
        if key not in dataset.column_names:
            continue
        kind = dataset.data.schema.field(key).type  # the rows themselves through dataset[...]: it keeps a selection
        if pa.types.is_floating(kind) or pa.types.is_integer(kind) or pa.types.is_null(kind):
            out[key] = np.asarray(dataset[key], dtype=np.float64)  # a missing value is NaN (named by row later)
            continue
        value = dataset[0][key]
        if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
            shape = f"a list of {len(value)} numbers" if value is not None else "a list"
            raise ValueError(
                f"row 0: column {key!r} holds {shape} (per-token log-probabilities?), and every row of it is a list; "
                "DPO takes one number per sequence: the reference model's log-probability of the whole completion, "
                f"the sum over its tokens (TRL's {key}). Sum each row's list over the completion's tokens, e.g. "
                f"dataset.map(lambda row: {{{key!r}: sum(row[{key!r}])}}), or drop the column and use "
                "DPO(reference='copy')."
            )
        raise ValueError(
            f"row 0: column {key!r} is {short_repr(value)} ({kind}); reference log-probabilities are one number "
            "per sequence (a float column). Convert the column to floats, or drop it and use DPO(reference='copy')."
        )
    return out
