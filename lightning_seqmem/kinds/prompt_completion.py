"""Prompt/completion rows (``prompt`` and ``completion`` text, or ``prompt_ids`` and ``completion_ids``): the
prompt carries the BOS, the completion the EOS; ``max_prompt_length`` keeps the prompt's end,
``max_completion_length`` the completion's start, then ``max_length`` cuts by ``truncation_side``
(``truncation.PromptCompletionLimits``); labels -100 on the prompt with ``completion_only_loss``. A row left
without a completion is skipped and counted (``rows_without_completion``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from lightning_seqmem.batch import IGNORE_INDEX
from lightning_seqmem.batching.settings import SPLITS
from lightning_seqmem.batching.strategies import Strategy
from lightning_seqmem.batching.truncation import (
    PromptCompletionLengths,
    prompt_completion_example,
    prompt_completion_spans,
)
from lightning_seqmem.data.tokens import ConcatView, ConstantView
from lightning_seqmem.kinds.base import Documents, Kind, SplitRows, count_document


class PromptCompletion(Kind):
    """Prompt/completion pairs, trained on the completion (``completion_only_loss``) or on both."""

    name = "prompt_completion"
    parts = {"prompt": "prompt_ids", "completion": "completion_ids"}
    stats_keys = ("rows_without_completion",)
    default_overflow = "truncate"
    planned = False  # seqmem-plan alone draws its prompt and completion lengths; as a source of a Mix it is planned

    def check(self, batching: Any) -> None:
        """Rows must fit ``max_length`` after the per-part limits (``max_prompt_length + max_completion_length``),
        and packing splits them only when asked twice (``Pack(overflow='split',
        allow_split_prompt_completion=True)``): every piece after the first would train on completion tokens
        without their prompt."""
        _ = batching.limits  # the per-part limits must fit max_length
        packs = [b for b in map(batching.batching_for, SPLITS) if b.packs]
        if any(b.overflow == "split" and not b.allow_split_prompt_completion for b in packs):
            raise ValueError(
                "Pack(overflow='split') would cut long prompt/completion rows into pieces, and every piece after the "
                "first would train on completion tokens without their prompt. Leave Pack(overflow=None) (truncate: "
                "keep the prompt's end and the completion's start), or pass batching=Pack(overflow='split', "
                "allow_split_prompt_completion=True) to split anyway."
            )

    def source_columns(self, text_column: str = "text") -> list[str]:
        return list(self.id_columns) if self.pretokenized else ["prompt", "completion"]

    def plan_lengths(self, docs: Documents, settings: Any) -> PromptCompletionLengths:
        """Prompt and completion counts, cut per candidate by the strategy's limits as :meth:`split_rows` cuts them
        (planned as a source of a ``Mix``)."""
        parts = docs.parts
        return PromptCompletionLengths(
            parts["prompt"].lengths, parts["completion"].lengths, settings.batching.completion_only_loss
        )

    def text_encoder(self, tokenizer: Any, text_column: str, conversation: Any):
        from lightning_seqmem.data.encode import prompt_completion_function

        return prompt_completion_function(tokenizer)

    def split_rows(self, split: str, docs: Documents, strategy: Strategy, settings: Any) -> SplitRows:
        """Truncate the pairs once, at dataset level and on lengths, so every cut token is counted exactly; rows
        are views (the kept part of the prompt, then of the completion), gathered when served."""
        prompt, completion = docs.parts["prompt"], docs.parts["completion"]
        p_off, p_keep, c_keep = prompt_completion_spans(
            prompt.lengths, completion.lengths, strategy.prompt_completion_limits
        )
        truncated = int((prompt.lengths + completion.lengths - p_keep - c_keep).sum())
        kept = np.flatnonzero(c_keep > 0)
        emptied = len(c_keep) - len(kept)  # nothing to learn from: reported, never trained on silently
        truncated += int((p_keep[c_keep == 0]).sum())
        prompt = prompt.trim(p_off, p_keep).select(kept)
        completion = completion.trim(np.zeros_like(c_keep), c_keep).select(kept)
        only = settings.batching.completion_only_loss
        labels = ConcatView(ConstantView(IGNORE_INDEX, prompt.lengths) if only else prompt, completion)
        warnings = (
            [
                f"{split}: {emptied} prompt/completion rows have no completion left after truncation and are "
                "skipped. Lower max_prompt_length or raise max_length to keep them."
            ]
            if emptied
            else []
        )
        stats = {"tokens_truncated": truncated, "rows_without_completion": emptied}
        return SplitRows(ConcatView(prompt, completion), labels, docs.dataset, stats, warnings)

    def lost_tokens_fix(self, strategy: Strategy) -> str:
        return strategy.lost_tokens_fix(True)

    def stream_row(self, row: dict, index: Any, settings: Any, strategy: Strategy, counts: Counter):
        p, c = list(row["prompt_ids"]), list(row["completion_ids"])
        if not len(p) + len(c):
            counts["empty_documents_skipped"] += 1
            return []
        limits = strategy.prompt_completion_limits
        count_document(counts, len(p) + len(c))
        cut = prompt_completion_example(p, c, limits, settings.batching.completion_only_loss)
        counts["documents_over_max_length"] += limits.max_length is not None and len(p) + len(c) > limits.max_length
        counts["tokens_truncated"] += cut["num_truncated"]
        if not cut["completion_length"]:
            counts["rows_without_completion"] += 1
            counts["tokens_truncated"] += len(cut["input_ids"])  # the prompt left: nothing to learn from it
            return []
        return {"input_ids": cut["input_ids"], "labels": cut["labels"]}
