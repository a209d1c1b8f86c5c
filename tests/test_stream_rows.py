"""The rows the streaming packer hands out: arrays the collator takes as they are, nothing for the collector."""

import gc

import numpy as np

from lightning_seqmem.batching.collate import PackCollator
from lightning_seqmem.batching.streaming_packer import StreamingPacker


def test_streamed_rows_are_int32_arrays_the_collator_takes_and_the_collector_skips():
    """A Python list per row cost more than packing it, and rows kept alive (a loader's prefetched batches) made
    the garbage collector walk every token: rows are int32 arrays, untracked, and collate as the lists did."""
    docs = [list(range(1, n + 1)) for n in (5, 9, 3, 12, 7, 2, 8)]
    labelled = [{"input_ids": d, "labels": [-100] + d[1:]} for d in docs]
    for items in (docs, labelled):
        rows = list(StreamingPacker(16, buffer_size=4)(iter(items)))
        for row in rows:
            assert row["input_ids"].dtype == np.int32 and not gc.is_tracked(row["input_ids"])
            assert sum(row["seq_lengths"]) == len(row["input_ids"])
            if items is labelled:
                assert row["labels"].dtype == np.int32 and len(row["labels"]) == len(row["input_ids"])
        as_lists = [{k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in row.items()} for row in rows]
        collate = PackCollator(pad_token_id=0, max_length=16)
        for got, expected in zip(collate(rows).values(), collate(as_lists).values()):
            assert np.array_equal(got, expected)
        packed = sorted(tuple(r["input_ids"].tolist()) for r in rows)
        assert sum(len(p) for p in packed) == sum(len(d) for d in docs)  # every token once
