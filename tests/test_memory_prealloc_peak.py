"""The pre-allocation pass holds at least the peak of every real training step (CPU, measured by torch.profiler).

What stands in for the GPU: the profiler's count of live tensor bytes (what the caching allocator must hold), not
reserved memory. The run is a sequence-length warmup on pre-tokenized documents of mixed lengths, so real batches
are padded inside rows (pad) or hold several documents per row (pack), and transformers builds its 4-D attention
mask for them. The vocabulary is small and rows long, so that mask and its per-layer float copy are a large part of
the step: the negative control, today's batch (all ones, one document per row, mask-free path), falls short.
"""

import gc

import datasets
import lightning.pytorch as L
import numpy as np
import pytest
from _memory_peaks import StepRanges, range_peaks
from torch.profiler import ProfilerActivity, profile

from lightning_seqmem import CausalLM, SeqMemDataModule
from lightning_seqmem.batch import full_rows
from lightning_seqmem.memory.preallocate import CachePreallocator
from lightning_seqmem.warmup.callback import SeqLengthWarmup

VOCAB, LENGTH = 64, 256


class OneDocumentRows(SeqMemDataModule):
    """The negative control: says its worst batch is full rows of one document (the old dummy batch)."""

    def worst_batch_layout(self, rows, length):
        return full_rows(rows, length)


def _documents():
    g = np.random.default_rng(0)
    lengths = np.where(g.random(64) < 0.5, g.integers(300, 900, 64), g.integers(5, 200, 64))
    return datasets.Dataset.from_dict({"input_ids": [g.integers(2, VOCAB, n).tolist() for n in lengths]})


def _peaks(data, strategy, datamodule_class=SeqMemDataModule, max_steps=6):
    def fit():
        L.seed_everything(0)
        dm = datamodule_class(dataset=data, strategy=strategy, max_length=LENGTH, micro_batch_size=2, pad_token_id=0)
        config = dict(
            model_type="llama",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=LENGTH,
        )
        model = CausalLM(model_config=config, vocab_size=VOCAB, pad_token_id=0)
        warmup = SeqLengthWarmup(duration=0.5, min_seq_length=32, max_seq_length=LENGTH)
        L.Trainer(
            max_steps=max_steps,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            gradient_clip_val=1.0,
            callbacks=[warmup, CachePreallocator(), StepRanges()],
        ).fit(model, datamodule=dm)

    # Garbage from earlier tests freed inside a profiled step would count as negative live bytes there: collect it
    # first and keep the collector out of the profiled run.
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fit()
    finally:
        gc.enable()
    return range_peaks(prof)


@pytest.mark.parametrize("strategy", ["pad", "pack"])
def test_pass_holds_the_peak_of_every_real_step(strategy):
    data = _documents()
    peaks = _peaks(data, strategy)
    (reserved,), steps = peaks["CachePreallocator"], peaks["train_step"]
    assert len(steps) == 6
    worst = max(steps)
    assert worst * 0.99 <= reserved <= worst * 1.01, (reserved, steps)
    # the negative control: the same pass with the mask-free one-document batch falls short of the real steps
    (old,) = _peaks(data, strategy, OneDocumentRows, max_steps=1)["CachePreallocator"]
    assert old < worst * 0.99, (old, worst)
