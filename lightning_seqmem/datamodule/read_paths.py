"""The 2 x 2 of read paths: which read mode serves the data, by two independent axes.

Sources: one dataset, or a ``Mix`` of several (each source read as one dataset would be, its rows interleaved by
weight). Read: map-style (whole splits planned, rows gathered on demand) or streamed (packed on the fly). Every
mode answers the same ``read_mode.ReadMode`` questions, saves one kind of signature (``signature.read_signature``)
and resumes by one policy (``resume.check_signature``); what differs is only how rows are read:

|            | one source                 | a ``Mix``                                |
|------------|----------------------------|------------------------------------------|
| map-style  | ``map_style.MapStyle``     | ``mix_mode.MixMode``                     |
| streamed   | ``stream_mode.StreamMode`` | ``stream_mix_mode.StreamMixMode``        |

No Lightning import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_seqmem.datamodule.map_style import MapStyle
from lightning_seqmem.datamodule.mix_mode import MixMode
from lightning_seqmem.datamodule.read_mode import ReadMode
from lightning_seqmem.datamodule.stream_mix_mode import StreamMixMode
from lightning_seqmem.datamodule.stream_mode import StreamMode
from lightning_seqmem.mixing.spec import Mix

__all__ = ["read_mode_for"]


def read_mode_for(
    dataset: Any,
    stream: bool,
    documents: Callable[[], Any],
    settings: Any,
    tokenizer: Callable[[], Any],
    explicit_tokenizer: bool,
    warn: Callable[[str], None],
    info: Callable[[str], None],
) -> ReadMode:
    """The read mode of ``dataset``: a ``Mix`` (its sources streamed with ``settings.data.streaming``) or one
    source (``stream``: already a stream). ``documents`` gives one source's kind (a stream) or its tokenized
    documents and kind (map-style), each read once per process by the DataModule."""
    if isinstance(dataset, Mix):
        if settings.data.streaming:
            return StreamMixMode(dataset, settings, warn, tokenizer)
        return MixMode(dataset, settings, tokenizer, explicit_tokenizer, warn, info)
    if stream:
        return StreamMode(dataset, documents(), settings, warn, tokenizer)
    # tokenized (or the cache prepare_data wrote, read) before a validation split is carved out, so errors name
    # rows of the dataset the user passed
    tokenized, kind = documents()
    return MapStyle(tokenized, kind, settings, tokenizer, warn, info, source=dataset)
