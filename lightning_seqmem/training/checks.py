"""Checks that ``CausalLM`` and ``DPO`` run before the first step, so that a setting or data that would train to
NaN, or fail deep inside a forward, is refused with the option (or row) named and the fix.

- numbers that must be finite (a learning rate of ``inf``, a DPO ``beta`` of NaN): ``nan <= 0`` is false, so a
  plain range check lets them through and the loss turns NaN at the first step;
- a model whose embedding table is smaller than the data's token ids, those its tokenizer makes or the largest id of
  pre-tokenized data (a bare ``IndexError`` at the first forward; a device-side assert on CUDA);
- ``DPO`` given data that are not preference pairs (a ``KeyError: 'completion_mask'`` at the first step).
"""

from __future__ import annotations

import math
from typing import Any

from lightning_seqmem.messages import short_repr
from lightning_seqmem.protocols import GivesLargestTokenId


def positive_finite(name: str, value: Any, fix: str) -> None:
    """Refuse ``value`` unless it is a finite number ``> 0``.

    Raises:
        ValueError: naming the option, the value and ``fix``.

    Example::

        >>> positive_finite("learning_rate", float("inf"), "use e.g. 1e-4")
        Traceback (most recent call last):
        ...
        ValueError: learning_rate=inf must be a finite number > 0 (a non-finite value trains to NaN): use e.g. 1e-4.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite number > 0 (a non-finite value trains to NaN): {fix}.")


def model_vocab_size(model: Any) -> int | None:
    """Rows of the model's input embedding table (``None`` where the model has none to ask)."""
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, NotImplementedError, TypeError):
        return None


def check_vocab_fits(model: Any, tokenizer: Any, datamodule: Any = None) -> None:
    """Refuse, before the first step, a model whose embedding table has fewer rows than the data's tokenizer has
    ids, or than the largest id of pre-tokenized data needs (a ``datamodule`` that answers
    ``protocols.GivesLargestTokenId``): every id at or above it fails the first forward with a bare ``IndexError``
    on CPU, and with a device-side assert that ends the process on CUDA. Streams of pre-tokenized ids are checked
    only where a tokenizer is given (their ids against it, as they are read): their largest id is known only once
    they are read.

    Raises:
        ValueError: naming both sizes (and, for pre-tokenized data, the split and column of the largest id) and
            the fix.
    """
    rows = model_vocab_size(model)
    if rows is None:
        return
    if tokenizer is not None and len(tokenizer) > rows:
        raise ValueError(
            f"The model's vocabulary has {rows} tokens (embedding rows) but the data's tokenizer has {len(tokenizer)} "
            f"(ids up to {len(tokenizer) - 1}): ids >= {rows} would fail the first forward with an IndexError. Leave "
            f"vocab_size unset (it is taken from the tokenizer), pass vocab_size={len(tokenizer)}, or train a model "
            "made for this tokenizer (resize its embeddings: model.resize_token_embeddings(len(tokenizer)))."
        )
    largest = datamodule.largest_token_id() if isinstance(datamodule, GivesLargestTokenId) else None
    if largest is None or largest.id < rows:
        return
    raise ValueError(
        f"The data's largest token id is {largest.id} (split {largest.split!r}, column {largest.column!r}) but the "
        f"model's vocabulary has {rows} tokens (embedding rows): ids >= {rows} would fail the first forward with an "
        f"IndexError (a device-side assert on CUDA). Pass vocab_size={largest.id + 1} (or the size of the vocabulary "
        "the data were tokenized with), or train a model made for these ids (resize a pretrained one's embeddings: "
        f"model.resize_token_embeddings({largest.id + 1}))."
    )


def require_bitsandbytes(option: str, kernels: str, fix: str, estimated: str, device: Any = None) -> None:
    """Refuse ``option`` (a setting that runs bitsandbytes' kernels: QLoRA's 4-bit base, the 8-bit optimizer) where
    they cannot run: without a CUDA device (``device``, else any visible one) or without bitsandbytes installed.

    Raises:
        ValueError: no CUDA device, naming ``option``, ``kernels`` and ``fix`` (and that ``seqmem-plan`` estimates
            ``estimated`` anyway).
        ImportError: bitsandbytes is not installed.
    """
    import torch

    where = torch.device(device) if device is not None else None
    if (where is not None and where.type != "cuda") or not torch.cuda.is_available():
        found = where if where is not None and where.type != "cuda" else "a machine without CUDA"
        raise ValueError(
            f"{option} needs a CUDA device for {kernels}, not {found}: {fix}. seqmem-plan estimates {estimated} on "
            "any machine."
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ImportError(
            f"{option} needs bitsandbytes: `pip install bitsandbytes` on the CUDA machine, or {fix}."
        ) from None


def describe_data(dm: Any) -> str:
    """The data a DataModule was given, for messages: its ``dataset`` argument, shortened."""
    dataset = getattr(dm, "dataset", None)
    return short_repr(dataset) if isinstance(dataset, str) else type(dataset).__name__


def check_preference_data(dm: Any) -> None:
    """Refuse, at setup, a ``SeqMemDataModule`` (set up) whose data are not preference pairs: DPO's loss reads the
    pairs' ``completion_mask``.

    Raises:
        ValueError: naming the data kind and dataset found, and the fix.
    """
    kind = getattr(getattr(dm, "read_mode", None), "kind", None)
    if kind is None or kind.sequences == 2:  # a pair per item: chosen and rejected
        return
    raise ValueError(
        f"DPO needs preference pairs (columns prompt/chosen/rejected, or prompt_ids/chosen_ids/rejected_ids), but "
        f"the DataModule holds {kind.name} data ({describe_data(dm)}). Give it a preference dataset (e.g. "
        "SeqMemDataModule('builtin_preference') or seqmem-train data=preference), or train these data with "
        "CausalLM (seqmem-train model=tiny_llama)."
    )


def check_pair_batch(batch: Any) -> None:
    """Refuse a batch that is not a pair batch (a user's own loader), naming the keys it has.

    Raises:
        ValueError: no ``completion_mask`` in the batch.
    """
    if "completion_mask" not in batch:
        raise ValueError(
            f"DPO needs pair batches (preference pairs: prompt/chosen/rejected) with a 'completion_mask'; this batch "
            f"has {short_repr(sorted(batch))}. Feed DPO a SeqMemDataModule of preference data."
        )
