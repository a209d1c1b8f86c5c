"""Sequence-length warmup: a pure batch transform, a pure schedule and the ``SeqLengthWarmup`` callback.

See ``README.md`` in this folder for the method card.
"""

from lightning_seqmem.warmup.callback import SeqLengthWarmup
from lightning_seqmem.warmup.schedule import seq_length_at, warmup_lengths
from lightning_seqmem.warmup.transform import reshaped_batch_shape, set_batch_sequence_length

__all__ = [
    "SeqLengthWarmup",
    "reshaped_batch_shape",
    "seq_length_at",
    "set_batch_sequence_length",
    "warmup_lengths",
]
