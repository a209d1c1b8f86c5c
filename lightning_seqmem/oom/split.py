"""How a micro-batch is cut in two when it does not fit: rows in halves, a packed row at a document boundary.

The pure half of ``on_oom="split"`` (:mod:`~lightning_seqmem.training.oom_steps` runs the parts). Every cut keeps
whole documents (whole preference pairs for pair batches), so the parts' summed losses and gradients are the
micro-batch's: rows never see each other, and the documents of a packed row only see themselves (``position_ids``
restart at 0 on each, the contract of :mod:`lightning_seqmem.batch`).

- text batches, ``[rows, length]``: the first ``rows // 2`` rows and the rest; a single packed row (``position_ids``,
  no ``attention_mask``) at the document start nearest its middle. A single padded row, or a packed row holding one
  document, cannot be cut (``None``).
- pair batches (``completion_mask``): padded ``[2P, L]`` (chosen rows, then rejected) by pairs, rows ``p`` and
  ``P + p`` together; packed (``sequence_index``) by rows, or a single row at a boundary no pair straddles, the
  sequences numbered again (chosen first) and the precomputed reference log-probabilities taken along.

``cu_seqlens`` is left out of the parts: the model computes its varlen arguments from ``position_ids``.
Torch only, no Lightning.

:class:`OomInjector` raises ``torch.OutOfMemoryError`` above a token count, in forward or in backward: how the tests
(and a user checking a run) make a CPU run out of memory where a GPU would.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lightning_seqmem.batch import COMPLETION_MASK, CU_SEQLENS, REF_LOGPS_KEYS, SEQUENCE_INDEX

Batch = dict[str, torch.Tensor]


def batch_tokens(batch: Batch) -> int:
    """Slots the model is fed (rows x length): what a micro-batch's activation memory grows with."""
    return int(batch["input_ids"].numel())


def split_batch(batch: Batch) -> tuple[Batch, ...] | None:
    """The micro-batch as two parts whose losses and gradients add up to its own (one part: a packed pair row
    without its padding tail), or ``None`` when it is a single document (a single pair) that no cut can make
    smaller."""
    if COMPLETION_MASK in batch:
        return _split_pairs(batch)
    rows, length = batch["input_ids"].shape
    if rows > 1:
        half = rows // 2
        return _take_rows(batch, slice(0, half)), _take_rows(batch, slice(half, rows))
    if "attention_mask" in batch or "position_ids" not in batch:
        return None  # one padded row: one document
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
    cut = _nearest_middle([s for s in starts if s > 0], length)
    if cut is None:
        return None
    return _take_columns(batch, slice(0, cut)), _take_columns(batch, slice(cut, length))


def pair_count(batch: Batch) -> int:
    """Pairs in a pair batch: half its rows (padded) or half its sequences (packed; one host read)."""
    if SEQUENCE_INDEX in batch:
        return int(pairs_on_device(batch))
    return batch["input_ids"].shape[0] // 2


def pairs_on_device(batch: Batch) -> torch.Tensor:
    """:func:`pair_count` as a 0-d tensor on the batch's device, with no host read (a loss weight: ``DPO``)."""
    if SEQUENCE_INDEX in batch:
        return (batch[SEQUENCE_INDEX].max() + 1) // 2
    return torch.tensor(pair_count(batch), device=batch["input_ids"].device)


def pre_split(batch: Batch, limit: int | None) -> list[Batch]:
    """The parts a micro-batch is run in when one of ``limit`` tokens or more ran out of memory before: halved
    until every part is below ``limit`` (or cannot be cut further)."""
    if limit is None or batch_tokens(batch) < limit:
        return [batch]
    halves = split_batch(batch)
    if halves is None:
        return [batch]
    return [part for half in halves for part in pre_split(half, limit)]


def _nearest_middle(cuts: Iterable[int], length: int) -> int | None:
    cuts = list(cuts)
    return min(cuts, key=lambda c: (abs(2 * c - length), c)) if cuts else None


def _take_rows(batch: Batch, rows: slice | torch.Tensor) -> Batch:
    """The rows' slice of every ``[rows, ...]`` tensor; ``cu_seqlens`` dropped, anything else kept as it is."""
    n = batch["input_ids"].shape[0]
    out = {}
    for key, value in batch.items():
        if key == CU_SEQLENS:
            continue
        row_tensor = isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == n
        out[key] = value[rows] if row_tensor and key not in REF_LOGPS_KEYS else value
    return out


def _take_columns(batch: Batch, columns: slice) -> Batch:
    """Columns of a single row: every ``[1, length]`` tensor cut alike."""
    length = batch["input_ids"].shape[1]
    out = {}
    for key, value in batch.items():
        if key == CU_SEQLENS:
            continue
        two_d = isinstance(value, torch.Tensor) and value.ndim == 2 and value.shape[1] == length
        out[key] = value[:, columns] if two_d else value
    return out


# ------------------------------------------------------------------------------------------------- pair batches
def _split_pairs(batch: Batch) -> tuple[Batch, ...] | None:
    """Two parts of whole pairs; a single packed row with padding after its last pair is first given back without
    that padding (one part: it scores the same, the padding masked and after every sequence it could attend from)."""
    if SEQUENCE_INDEX not in batch:
        pairs = pair_count(batch)
        if pairs < 2:
            return None
        halves = torch.arange(pairs).tensor_split(2)
        return tuple(_padded_pairs(batch, chosen, pairs) for chosen in halves)
    rows, length = batch["input_ids"].shape
    if rows > 1:
        parts = _take_rows(batch, slice(0, rows // 2)), _take_rows(batch, slice(rows // 2, rows))
    else:
        owned = (batch[SEQUENCE_INDEX][0] >= 0).nonzero().flatten()
        end = int(owned[-1]) + 1 if owned.numel() else length
        if end < length:
            return (_take_columns(batch, slice(0, end)),)
        cut = _nearest_middle(_pair_boundaries(batch), length)
        if cut is None:
            return None
        parts = _take_columns(batch, slice(0, cut)), _take_columns(batch, slice(cut, length))
    pairs = pair_count(batch)
    owned = [set(_pair_of(part[SEQUENCE_INDEX], pairs).flatten().tolist()) - {-1} for part in parts]
    if owned[0] & owned[1]:
        return None  # a pair across rows: not a layout our collators make
    return tuple(_renumber(part, sorted(own), pairs) for part, own in zip(parts, owned))


def _padded_pairs(batch: Batch, chosen: torch.Tensor, pairs: int) -> Batch:
    part = _take_rows(batch, torch.cat([chosen, chosen + pairs]))
    for key in REF_LOGPS_KEYS:
        if key in batch:
            part[key] = batch[key][chosen]
    return part


def _pair_of(index: torch.Tensor, pairs: int) -> torch.Tensor:
    """Each slot's pair (sequence ``s`` belongs to pair ``s mod P``), -1 on padding."""
    return torch.where(index >= 0, index % pairs, -1)


def _pair_boundaries(batch: Batch) -> list[int]:
    """Columns of a single packed pair row where a sequence starts, no pair has sequences on both sides and each
    side holds a pair: the padding after the last pair (its positions count from 0 too) stays with that pair, as a
    part of padding alone has no sequence to score."""
    pairs = pair_count(batch)
    owner = _pair_of(batch[SEQUENCE_INDEX][0], pairs)
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
    spans = []
    for pair in set(owner.tolist()) - {-1}:
        where = (owner == pair).nonzero().flatten()
        spans.append((int(where[0]), int(where[-1])))
    if not spans:
        return []
    lo, hi = min(first for first, _ in spans), max(last for _, last in spans)
    return [c for c in starts if lo < c <= hi and not any(first < c <= last for first, last in spans)]


def _renumber(part: Batch, own: list[int], pairs: int) -> Batch:
    """Number a part's sequences as a batch of its own: its pairs' chosen sequences first, then their rejected."""
    lookup = torch.full((2 * pairs + 1,), -1, dtype=part[SEQUENCE_INDEX].dtype)
    for new, pair in enumerate(own):
        lookup[pair], lookup[pair + pairs] = new, new + len(own)
    index = part[SEQUENCE_INDEX]
    part[SEQUENCE_INDEX] = lookup.to(index.device)[torch.where(index >= 0, index, 2 * pairs)]
    chosen = torch.tensor(own, dtype=torch.long)
    for key in REF_LOGPS_KEYS:
        if key in part:
            part[key] = part[key][chosen.to(part[key].device)]
    return part


# --------------------------------------------------------------------------------------------------- injection
class OomInjector:
    """Raise ``torch.OutOfMemoryError`` when a module is fed more than ``max_tokens`` slots: a CPU stand-in for a
    GPU that runs out of memory on large micro-batches.

    Install it on any module of the model, as a forward pre-hook (``where="forward"``: raised before the module
    runs) or so that the backward through the module's output raises (``where="backward"``: the forward succeeds,
    gradients of modules nearer the loss are already accumulated when it fires).

    Args:
        max_tokens: the most tokens that fit: rows x length of the module's first tensor argument of two
            dimensions or more (``input_ids``, or the hidden states a decoder layer is fed).
        where: ``"forward"`` or ``"backward"``.
        times: raise at most this many times (``None``: every time).

    Example::

        injector = OomInjector(max_tokens=64)
        handle = injector.install(model.model)  # the Hugging Face model inside CausalLM
        trainer.fit(model, datamodule=dm)  # micro-batches above 64 tokens run out of memory
        handle.remove()
    """

    def __init__(self, max_tokens: int, where: str = "forward", times: int | None = None) -> None:
        if where not in ("forward", "backward"):
            raise ValueError(f"where must be 'forward' or 'backward', got {where!r}.")
        self.max_tokens, self.where, self.times = max_tokens, where, times
        self.raised = 0

    def install(self, module: torch.nn.Module) -> torch.utils.hooks.RemovableHandle:
        if self.where == "forward":
            return module.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        return module.register_forward_hook(self._post_hook, with_kwargs=True)

    def _over(self, args: tuple, kwargs: dict) -> int | None:
        tensors = [*args, *kwargs.values()]
        shape = next((t.shape for t in tensors if isinstance(t, torch.Tensor) and t.ndim >= 2), None)
        tokens = None if shape is None else int(shape[0] * shape[1])
        if tokens is None or tokens <= self.max_tokens or (self.times is not None and self.raised >= self.times):
            return None
        return tokens

    def _raise(self, tokens: int) -> None:
        self.raised += 1
        raise torch.OutOfMemoryError(f"injected: {tokens} tokens > {self.max_tokens} (OomInjector)")

    def _pre_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        tokens = self._over(args, kwargs)
        if tokens is not None:
            self._raise(tokens)

    def _post_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict, output):
        tokens = self._over(args, kwargs)
        tensor = (
            output
            if isinstance(output, torch.Tensor)
            else next(
                (v for v in (output.values() if hasattr(output, "values") else output) if isinstance(v, torch.Tensor)),
                None,
            )
        )
        if tokens is not None and tensor is not None and tensor.requires_grad:

            def fail(grad: torch.Tensor) -> None:
                self._raise(tokens)

            tensor.register_hook(fail)
        return output
