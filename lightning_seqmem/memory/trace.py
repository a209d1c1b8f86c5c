"""Peak training memory without a GPU: trace a training step on fake tensors and count live bytes by category.

The model is built inside ``FakeTensorMode`` (tensors with shapes, dtypes and storages but no data), so a
7 B-parameter config costs seconds and no memory. :class:`LiveBytes`, a ``TorchDispatchMode``, sees every tensor
an aten op creates and keeps a weak reference to its storage: storage bytes are added when the storage is created
and removed when Python and autograd drop it, so the running total is the live tensor bytes, views counted once.
At the highest total it remembers which storages were alive; once the step is over, each is named: parameters,
gradients (what ``loss.backward()`` left in ``.grad``), optimizer state (what ``optimizer.step()`` keeps) or
activations (everything else: the batch, buffers, saved tensors and temporaries).

What is traced is what Lightning's automatic optimization runs, once, from the steady state a first step leaves
(:func:`steady_state`: gradients of the previous step are still alive during the forward, the optimizer state
exists)::

    loss = model(**batch).loss      # under autocast for *-mixed precision (or the chosen loss layer)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()

The kernels traced are the CPU kernels of this torch build (a CPU-only torch cannot run autograd on fake CUDA
tensors). For ``device="cuda"`` three things follow the GPU instead:

- AdamW uses its ``foreach`` implementation (torch's default on CUDA; its temporaries are traced), plain loops on
  CPU;
- each storage is rounded up to the CUDA caching allocator's 512-byte granule;
- attention follows ``attn_implementation``: ``eager`` materialises the ``[batch, heads, length, length]``
  scores and probabilities (traced as is); ``sdpa`` dispatches the CPU flash kernel, which, like CUDA's flash and
  memory-efficient kernels, keeps only the output and a ``[batch, heads, length]`` log-sum-exp (the
  ``[batch, 1, length, length]`` mask that ``transformers`` builds for padded or packed batches is traced, as on
  CUDA); ``flash_attention_2``/``_3`` run as a causal fused kernel without any mask (varlen kernels take
  ``position_ids``), the same saved tensors.

The loss layer follows ``cross_entropy`` (:mod:`lightning_seqmem.training.loss_layer`): the model's own head and
loss, or the base model and the chunked kernel. The chunked kernel keeps the label tokens only, a count that depends
on the labels' values; the tracer takes the worst case, every position trained (:func:`_every_index`). The storages
made from the end of the base model's forward until the gradient of its hidden states exists are the loss layer's
(the logits, their fp32 upcast and their gradient on the full path; one chunk at a time on the chunked one):
:meth:`LiveBytes.loss_layer` tells their bytes at the peak (a part of ``activations``).

Mixed precision is traced under CPU autocast with the same dtype; CUDA autocast casts the same matmul-class ops
(linear, matmul, bmm, scaled-dot-product attention) to 16 bits. Nothing the tracer cannot run is guessed: an op
without a fake implementation, or one whose output depends on tensor values, raises :class:`TraceError` naming it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_seqmem.memory.precision import autocast_dtype
from lightning_seqmem.training.adapters import is_peft_model
from lightning_seqmem.training.linear_cross_entropy import DEFAULT_CHUNK_SIZE, distinct_chunks_only
from lightning_seqmem.training.loss_layer import causal_lm_loss

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations")
CUDA_GRANULE = 512  # the CUDA caching allocator rounds every block up to a multiple of this


class TraceError(RuntimeError):
    """The tracer could not run the model (an op without a fake kernel, or a value-dependent op)."""


class _Record:
    __slots__ = ("nbytes", "category", "loss_layer")

    def __init__(self, nbytes: int, category: str, loss_layer: bool = False) -> None:
        self.nbytes, self.category, self.loss_layer = nbytes, category, loss_layer


class LiveBytes(TorchDispatchMode):
    """Live storage bytes of every tensor created by aten ops under this mode (or registered with :meth:`add`).

    Works on real and fake tensors alike. ``granule`` rounds each storage up (512 for the CUDA allocator).
    After the run, :meth:`mark` names the storages that turned out to be gradients or optimizer state, and
    :meth:`split` returns the bytes alive at the peak per category.
    """

    def __init__(self, granule: int = 1) -> None:
        super().__init__()
        self.granule = granule
        self.phase = "setup"
        self.total = 0
        self.peak = 0
        self.peak_phase = "setup"
        self._live: dict[int, _Record] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._at_peak: list[_Record] = []
        self._rising = False  # the total is at a new peak that has not been snapshotted yet
        self.in_loss_layer = False  # storages made now are the loss layer's (see watch_loss_layer)

    def add(self, tensor: torch.Tensor, category: str = "activations") -> None:
        """Count a tensor's storage (once, however many views share it)."""
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._live:
            if category != "activations":
                self._live[key].category = category
            return
        nbytes = -(-storage.nbytes() // self.granule) * self.granule
        record = _Record(nbytes, category, self.in_loss_layer)
        self._live[key] = record
        self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._free(key))
        self.total += nbytes
        if self.total > self.peak:
            self.peak, self.peak_phase, self._rising = self.total, self.phase, True

    def _free(self, key: int) -> None:
        record = self._live.pop(key, None)
        self._refs.pop(key, None)
        if record is None:
            return
        if self._rising:  # only allocations happened since the peak: what is alive now is what was alive then
            self._at_peak, self._rising = list(self._live.values()) + [record], False
        self.total -= record.nbytes

    def mark(self, tensors: Iterable[torch.Tensor | None], category: str) -> None:
        """Name the storages of ``tensors`` (alive now) ``category``, also in the peak snapshot."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                record = self._live.get(id(tensor.untyped_storage()))
                if record is not None:
                    record.category = category

    def split(self) -> dict[str, int]:
        """Bytes alive at the peak, per category."""
        if self._rising:
            self._at_peak, self._rising = list(self._live.values()), False
        out = dict.fromkeys(CATEGORIES, 0)
        for record in self._at_peak:
            out[record.category] += record.nbytes
        return out

    def loss_layer(self) -> int:
        """Bytes alive at the peak that the loss layer made (activations only: its weight gradient is a gradient)."""
        self.split()
        return sum(r.nbytes for r in self._at_peak if r.loss_layer and r.category == "activations")

    def live_split(self) -> dict[str, int]:
        """Bytes alive now, per category."""
        out = dict.fromkeys(CATEGORIES, 0)
        for record in self._live.values():
            out[record.category] += record.nbytes
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _NONZERO and self.in_loss_layer:
            with self:  # its indices made under this mode too, counted as any op's output
                return _every_index(args[0])
        out = func(*args, **(kwargs or {}))
        for tensor in _tensors(out):
            self.add(tensor)
        return out


_NONZERO = torch.ops.aten.nonzero.default


def _every_index(mask: torch.Tensor) -> torch.Tensor:
    """``nonzero`` of a ``[d0, d1, ...]`` mask as its worst case, every index: while the tracker is in the loss layer
    the tokens a chunked loss keeps are all of them (fake tensors have no values to count). Anywhere else a
    value-dependent op stays an error (:func:`trace_errors`). Answered by :class:`LiveBytes` itself: a second
    dispatch mode for this one op cost every traced op a tenth more time."""
    ranges = [torch.arange(n, device=mask.device) for n in mask.shape]
    return torch.stack(torch.meshgrid(*ranges, indexing="ij"), dim=-1).reshape(-1, mask.dim())


def watch_loss_layer(model: torch.nn.Module, tracker: LiveBytes):
    """Tell ``tracker`` when the loss layer runs: from the end of the base model's forward (a forward hook) until
    the gradient of its hidden states is computed in backward (a tensor hook). Returns the hook handle."""

    def end(grad: torch.Tensor) -> None:
        tracker.in_loss_layer = False

    def start(module, args, output) -> None:
        hidden = output[0] if isinstance(output, (tuple, list)) else getattr(output, "last_hidden_state", None)
        if not isinstance(hidden, torch.Tensor):
            return  # not a decoder's output: nothing to watch
        tracker.in_loss_layer = True
        if hidden.requires_grad:
            hidden.register_hook(end)

    inner = model.get_base_model() if is_peft_model(model) else model  # under PEFT, the causal LM it wraps
    base = getattr(inner, "base_model", None)  # a Hugging Face model's decoder; a model of one's own may have none
    return (base if isinstance(base, torch.nn.Module) else model).register_forward_hook(start)


def _tensors(out: Any) -> Iterable[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for item in out:
            if isinstance(item, torch.Tensor):
                yield item


# ------------------------------------------------------------------------------------------------- the step
def adamw(model: torch.nn.Module, device: str) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, ``foreach`` as torch picks it on ``device`` (parameter groups, such as
    ``CausalLM``'s weight-decay split, change no memory: the state is per parameter)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, foreach=device == "cuda")


def steady_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tracker: LiveBytes) -> None:
    """Give ``model`` what a first training step leaves (a gradient per trainable parameter, the optimizer's state,
    both counted by ``tracker``), so that one traced step is the second, steady one: the first holds less in every
    phase (no gradients in its forward, no optimizer state before its step, which then allocates what the second
    step finds, with the same temporaries). Tracing the first step too would cost a forward and a backward more
    and change no peak."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    tracker.mark(params, "parameters")
    for p in params:
        tracker.add(p.grad, "gradients")
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                tracker.add(value, "optimizer_state")


def trace_training_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Mapping[str, torch.Tensor],
    precision: str = "32-true",
    steps: int = 2,
    granule: int = 1,
    cross_entropy: str = "full",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    tracker: LiveBytes | None = None,
) -> LiveBytes:
    """Run :func:`lightning_steps` under a :class:`LiveBytes` and return it (real or fake tensors).

    The parameters, buffers and batch, created before, are counted from the start; ``granule`` rounds each storage
    (``CUDA_GRANULE`` for a CUDA estimate); the loss layer is watched (:func:`watch_loss_layer`) and a chunked one
    keeps every position (:func:`_every_index`), running its first and last chunk only (``distinct_chunks_only``:
    the same peak). ``tracker``: a fresh one of a subclass (``layer_scaling``'s).
    """
    tracker = LiveBytes(granule) if tracker is None else tracker
    for p in model.parameters():
        tracker.add(p, "parameters")
    for buffer in model.buffers():
        tracker.add(buffer)
    for value in batch.values():
        tracker.add(value)
    handle = watch_loss_layer(model, tracker)
    try:
        with tracker, distinct_chunks_only():
            lightning_steps(model, optimizer, batch, precision, steps, tracker, cross_entropy, chunk_size)
    finally:
        handle.remove()
    return tracker


def lightning_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Mapping[str, torch.Tensor],
    precision: str = "32-true",
    steps: int = 2,
    tracker: LiveBytes | None = None,
    cross_entropy: str = "full",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> None:
    """``steps`` training steps in the order of Lightning's automatic optimization (see the module docstring).

    Args:
        model: a Hugging Face causal LM (its output has ``.loss``), in train mode.
        optimizer: over ``model``'s parameters.
        batch: ``[rows, length]`` tensors with ``labels``.
        precision: ``*-mixed`` runs the forward under autocast of that dtype, on the batch's device type.
        steps: 2 reaches the steady state (gradients alive in the forward, optimizer state allocated).
        tracker: told the phase, and which storages are gradients and optimizer state.
        cross_entropy, chunk_size: the loss layer (``"full"``, ``"chunked"``; ``loss_layer.causal_lm_loss``).
    """
    dtype = autocast_dtype(precision)
    device_type = next(iter(batch.values())).device.type  # fake tensors report the device they stand for
    autocast = (lambda: torch.autocast(device_type, dtype=dtype)) if dtype is not None else contextlib.nullcontext
    params = list(model.parameters())
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    for _ in range(steps):
        if tracker is not None:
            tracker.phase = "forward"
        with autocast():
            loss = causal_lm_loss(model, inputs, batch["labels"], cross_entropy, chunk_size)
        if tracker is not None:
            tracker.phase = "backward"
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        del loss
        if tracker is not None:
            tracker.mark((p.grad for p in params), "gradients")
            tracker.phase = "optimizer"
        optimizer.step()
        if tracker is not None:
            tracker.mark((t for state in optimizer.state.values() for t in state.values()), "optimizer_state")


@contextlib.contextmanager
def trace_errors(model_config):
    """Turn fake-tensor failures into a :class:`TraceError` that names the op (never a silent wrong number)."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )

    name = getattr(model_config, "model_type", type(model_config).__name__)
    try:
        yield
    except UnsupportedOperatorException as error:
        raise TraceError(
            f"The memory tracer cannot run model_type={name!r}: op {error.func} has no fake-tensor kernel. "
            "Estimate a model made of standard ops, or measure on the GPU (CachePreallocator)."
        ) from error
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        raise TraceError(
            f"The memory tracer cannot run model_type={name!r}: op {error.func} needs tensor values (the "
            "tracer has shapes only). Measure this model on the GPU instead (CachePreallocator)."
        ) from error
