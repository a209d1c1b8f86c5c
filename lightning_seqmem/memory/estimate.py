"""Peak training memory without a GPU: trace a training step on fake tensors and count live bytes by category.

The model is built inside ``FakeTensorMode`` (tensors with shapes, dtypes and storages but no data), so a
7 B-parameter config costs seconds and no memory. :class:`LiveBytes`, a ``TorchDispatchMode``, sees every tensor
an aten op creates and keeps a weak reference to its storage: storage bytes are added when the storage is created
and removed when Python and autograd drop it, so the running total is the live tensor bytes, views counted once.
At the highest total it remembers which storages were alive; once the step is over, each is named: parameters,
gradients (what ``loss.backward()`` left in ``.grad``), optimizer state (what ``optimizer.step()`` keeps) or
activations (everything else: the batch, buffers, saved tensors and temporaries).

What is traced is what Lightning's automatic optimization runs, twice (the second step is the steady state:
gradients of the previous step are still alive during the forward, the optimizer state exists)::

    loss = model(**batch).loss      # under autocast for *-mixed precision
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

Mixed precision is traced under CPU autocast with the same dtype; CUDA autocast casts the same matmul-class ops
(linear, matmul, bmm, scaled-dot-product attention) to 16 bits. Nothing the tracer cannot run is guessed: an op
without a fake implementation, or one whose output depends on tensor values, raises :class:`TraceError` naming it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_seqmem.memory.worst_batch import make_dummy_batch

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations")
CUDA_GRANULE = 512  # the CUDA caching allocator rounds every block up to a multiple of this
PRECISIONS = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
_ALIASES = {"32": "32-true", 32: "32-true", "64": "64-true", 64: "64-true", "bf16": "bf16-mixed",
            "16": "16-mixed", 16: "16-mixed"}
_FLASH_TRACE = "seqmem_fused_causal"  # attention registered for tracing flash_attention_2/3 (see _flash_attention)


class TraceError(RuntimeError):
    """The tracer could not run the model (an op without a fake kernel, or a value-dependent op)."""


def normalize_precision(precision: Any) -> str:
    """A Lightning precision (``"bf16-mixed"``, ``"32"``, ``16`` ...) as one of :data:`PRECISIONS`."""
    value = _ALIASES.get(precision, precision)
    if value not in PRECISIONS:
        raise ValueError(
            f"precision={precision!r} cannot be estimated; use one of {list(PRECISIONS)} (fp8/transformer-engine "
            "and quantized precisions are not traced)."
        )
    return value


def parameter_dtype(precision: str) -> torch.dtype:
    """The dtype the weights (and so gradients and AdamW state) are kept in under ``precision``."""
    return {"64-true": torch.float64, "bf16-true": torch.bfloat16, "16-true": torch.float16}.get(
        normalize_precision(precision), torch.float32)


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a ``*-mixed`` precision, else ``None``."""
    return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(normalize_precision(precision))


def closed_form_state_bytes(num_parameters: int, num_tensors: int, precision: str = "32-true") -> dict[str, int]:
    """Parameter, gradient and AdamW state bytes: ``p + p + 2p`` bytes per parameter for weights of ``p`` bytes
    (4 + 4 + 8 in fp32 and in the mixed precisions, whose weights stay fp32; 2 + 2 + 4 in bf16/16-true), plus
    AdamW's fp32 step counter, one per parameter tensor."""
    size = torch.empty((), dtype=parameter_dtype(precision)).element_size()
    return {"parameters": size * num_parameters, "gradients": size * num_parameters,
            "optimizer_state": 2 * size * num_parameters + 4 * num_tensors}


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak live tensor bytes of a training step, split by category at the peak (the four add up to ``peak``).

    ``state`` holds the full parameter, gradient and optimizer-state bytes (all alive right after
    ``optimizer.step()``), which the split at the peak can show only partly when the peak falls in backward.
    """

    rows: int
    length: int
    device: str
    precision: str
    attn_implementation: str
    gradient_checkpointing: bool
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    peak: int
    peak_phase: str  # forward | backward | optimizer
    num_parameters: int
    state: Mapping[str, int]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Record:
    __slots__ = ("nbytes", "category")

    def __init__(self, nbytes: int, category: str) -> None:
        self.nbytes, self.category = nbytes, category


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

    def add(self, tensor: torch.Tensor, category: str = "activations") -> None:
        """Count a tensor's storage (once, however many views share it)."""
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._live:
            if category != "activations":
                self._live[key].category = category
            return
        nbytes = -(-storage.nbytes() // self.granule) * self.granule
        record = _Record(nbytes, category)
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

    def live_split(self) -> dict[str, int]:
        """Bytes alive now, per category."""
        out = dict.fromkeys(CATEGORIES, 0)
        for record in self._live.values():
            out[record.category] += record.nbytes
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in _tensors(out):
            self.add(tensor)
        return out


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


def trace_training_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Mapping[str, torch.Tensor],
    precision: str = "32-true",
    steps: int = 2,
    granule: int = 1,
) -> LiveBytes:
    """Run :func:`lightning_steps` under a :class:`LiveBytes` and return it (real or fake tensors).

    The parameters, buffers and batch, created before, are counted from the start; ``granule`` rounds each storage
    (``CUDA_GRANULE`` for a CUDA estimate).
    """
    tracker = LiveBytes(granule)
    for p in model.parameters():
        tracker.add(p, "parameters")
    for buffer in model.buffers():
        tracker.add(buffer)
    for value in batch.values():
        tracker.add(value)
    with tracker:
        lightning_steps(model, optimizer, batch, precision, steps, tracker)
    return tracker


def lightning_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Mapping[str, torch.Tensor],
    precision: str = "32-true",
    steps: int = 2,
    tracker: LiveBytes | None = None,
) -> None:
    """``steps`` training steps in the order of Lightning's automatic optimization (see the module docstring).

    Args:
        model: a Hugging Face causal LM (its output has ``.loss``), in train mode.
        optimizer: over ``model``'s parameters.
        batch: ``[rows, length]`` tensors with ``labels``.
        precision: ``*-mixed`` runs the forward under autocast of that dtype, on the batch's device type.
        steps: 2 reaches the steady state (gradients alive in the forward, optimizer state allocated).
        tracker: told the phase, and which storages are gradients and optimizer state.
    """
    dtype = autocast_dtype(precision)
    device_type = next(iter(batch.values())).device.type  # fake tensors report the device they stand for
    autocast = (lambda: torch.autocast(device_type, dtype=dtype)) if dtype is not None else contextlib.nullcontext
    params = list(model.parameters())
    for _ in range(steps):
        if tracker is not None:
            tracker.phase = "forward"
        with autocast():
            loss = model(**batch, use_cache=False).loss
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


def _flash_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Stand-in for flash-attention 2/3 when tracing: a causal fused kernel, no mask, ``[batch, length, heads, dim]``
    out. Keeps what flash keeps for backward (output and log-sum-exp), so the memory is flash's."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _register_flash_trace() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(_FLASH_TRACE, _flash_attention)
    AttentionMaskInterface.register(_FLASH_TRACE, lambda *args, **kwargs: None)


def _traced_attention(attn_implementation: str) -> str:
    if attn_implementation in ("eager", "sdpa"):
        return attn_implementation
    if attn_implementation == "auto":  # torch_varlen or sdpa: sdpa's mask makes it the larger of the two
        return "sdpa"
    # torch's varlen kernel, like flash, builds no mask and keeps [tokens, heads, dim] activations
    if attn_implementation.startswith("flash_attention") or attn_implementation == "torch_varlen":
        _register_flash_trace()
        return _FLASH_TRACE
    raise ValueError(
        f"attn_implementation={attn_implementation!r} cannot be estimated; use 'sdpa', 'eager', 'auto', "
        "'torch_varlen' or 'flash_attention_2'."
    )


def _enable_checkpointing(model) -> None:
    """Recompute each layer in backward (transformers 5 renamed the method; the older name warns)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def build_fake_model(model_config, attn_implementation: str = "sdpa", precision: str = "32-true",
                     gradient_checkpointing: bool = False):
    """A Hugging Face causal LM from a ``transformers`` config, built in a fresh ``FakeTensorMode``.

    Returns ``(mode, model)``; nothing is allocated for real.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    implementation = _traced_attention(attn_implementation)
    mode = FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False)
    with _trace_errors(model_config), mode:
        dtype = parameter_dtype(precision)  # built in its dtype: fake parameters cannot be cast in place
        extra = {} if dtype == torch.float32 else {"dtype": dtype}
        model = AutoModelForCausalLM.from_config(model_config, attn_implementation=implementation, **extra)
    # A packed batch has no attention_mask, so models that warn about padding (gpt2) read token values to decide;
    # fake tensors have none. The warning changes no memory: skip it in the traced model.
    for module in model.modules():
        if hasattr(module, "warn_if_padding_and_no_attention_mask"):
            module.warn_if_padding_and_no_attention_mask = lambda *args, **kwargs: None
    model.train()
    if gradient_checkpointing:
        _enable_checkpointing(model)
    return mode, model


@contextlib.contextmanager
def _trace_errors(model_config):
    """Turn fake-tensor failures into a :class:`TraceError` that names the op (never a silent wrong number)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch._subclasses.fake_tensor import UnsupportedOperatorException

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


def estimate_training_memory(
    model_config,
    rows: int,
    length: int,
    keys: Sequence[str] = ("input_ids", "attention_mask", "labels"),
    precision: str = "32-true",
    device: str = "cuda",
    attn_implementation: str = "sdpa",
    gradient_checkpointing: bool = False,
    model: tuple[Any, torch.nn.Module] | None = None,
) -> MemoryEstimate:
    """Peak live tensor bytes of training ``model_config`` on ``[rows, length]`` batches, traced on fake tensors.

    Args:
        model_config: a ``transformers`` config (``lightning_seqmem.training.model.build_model_config`` builds one from
            the presets).
        rows, length: the batch shape (the run's worst case: ``SeqMemDataModule.max_batch_shape()``).
        keys: the batch keys (``batch_keys()``): padded batches carry an ``attention_mask``, packed ones
            ``position_ids``.
        precision: a Lightning precision (see :data:`PRECISIONS`).
        device: ``"cuda"`` (foreach AdamW, 512-byte allocator granule) or ``"cpu"``.
        attn_implementation: ``"sdpa"``, ``"eager"`` or ``"flash_attention_2"``.
        gradient_checkpointing: recompute each layer's activations in backward.
        model: a ``(mode, model)`` pair from :func:`build_fake_model` to reuse (its parameters must have no
            gradients and its optimizer no state: pass a fresh one per estimate, or leave ``None``).

    Raises:
        ValueError: a shape below 1, an unknown precision, device or attention implementation.
        TraceError: the model uses an op the tracer cannot run (the message names it).

    Example::

        from lightning_seqmem.training.model import build_model_config
        est = estimate_training_memory(build_model_config("tiny_llama", 32000, 0), rows=8, length=2048)
        est.peak, est.activations
    """
    if not (isinstance(rows, int) and isinstance(length, int)) or rows < 1 or length < 1:
        raise ValueError(f"rows and length must be ints >= 1, got rows={rows!r}, length={length!r}.")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r}: estimates are for 'cuda' or 'cpu'.")
    precision = normalize_precision(precision)
    mode, module = model or build_fake_model(model_config, attn_implementation, precision, gradient_checkpointing)
    granule = CUDA_GRANULE if device == "cuda" else 1
    # The pre-allocation pass's batch (real, small: made outside the mode, which turns it into fake tensors)
    batch = make_dummy_batch(rows, length, keys, int(model_config.vocab_size))
    with _trace_errors(model_config), mode:
        optimizer = adamw(module, device)
        tracker = trace_training_steps(module, optimizer, batch, precision, granule=granule)
    split = tracker.split()
    state = tracker.live_split()
    del state["activations"]
    params = [p for p in module.parameters()]
    module.zero_grad(set_to_none=True)  # the model can be traced again
    return MemoryEstimate(
        rows=rows, length=length, device=device, precision=precision, attn_implementation=attn_implementation,
        gradient_checkpointing=gradient_checkpointing, peak=tracker.peak, peak_phase=tracker.peak_phase,
        num_parameters=sum(p.numel() for p in params), state=state, **split,
    )


def largest_fitting(estimate: Callable[[int], MemoryEstimate], budget: int, candidates: Sequence[int]):
    """The largest candidate ``micro_batch_size`` whose ``estimate(rows).peak <= budget`` and all estimates made.

    Memory grows with rows, so the search stops at the first candidate (in increasing order) that does not fit.
    Returns ``(best or None, {rows: MemoryEstimate})``.
    """
    best, seen = None, {}
    for rows in sorted(set(candidates)):
        seen[rows] = estimate(rows)
        if seen[rows].peak > budget:
            break
        best = rows
    return best, seen


def measured_peak_bytes(run: Callable[[], Any]) -> int:
    """Peak live tensor bytes of the real allocations ``run()`` makes (CPU or CUDA), from ``torch.profiler``.

    An independent check of the tracer: the profiler records every allocation and free of torch's allocators
    (``profile_memory=True``); the peak of their running sum is the peak of live tensor bytes since ``run``
    started, with no dispatch-level bookkeeping of ours involved. Build the model inside ``run`` so its weights
    count too.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    allocations, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.typed[0] == _EventType.Allocation:
            allocations.append((event.start_time_ns, event.typed[1].alloc_size))
        stack.extend(event.children)
    live = peak = 0
    for _, size in sorted(allocations):
        live += size
        peak = max(peak, live)
    return peak


def measured_training_peak(
    model_config,
    batch: Mapping[str, torch.Tensor],
    precision: str = "32-true",
    attn_implementation: str = "sdpa",
    gradient_checkpointing: bool = False,
    seed: int = 0,
) -> int:
    """Peak live tensor bytes of the same steps :func:`estimate_training_memory` traces, run for real on CPU.

    The model is built inside the measured region (its weights count) with real random weights; measured with
    :func:`measured_peak_bytes` (the profiler), not with :class:`LiveBytes`.
    """
    from transformers import AutoModelForCausalLM

    precision = normalize_precision(precision)
    implementation = _traced_attention(attn_implementation)

    def run() -> None:
        torch.manual_seed(seed)
        dtype = parameter_dtype(precision)
        extra = {} if dtype == torch.float32 else {"dtype": dtype}
        model = AutoModelForCausalLM.from_config(model_config, attn_implementation=implementation, **extra)
        model.train()
        if gradient_checkpointing:
            _enable_checkpointing(model)
        lightning_steps(model, adamw(model, "cpu"), batch, precision)

    return measured_peak_bytes(run)


_ESTIMATES: dict[tuple, MemoryEstimate] = {}


def cached_estimate(model_config, rows: int, length: int, keys: Sequence[str], precision: str = "32-true",
                    device: str = "cuda", attn_implementation: str = "sdpa",
                    gradient_checkpointing: bool = False) -> MemoryEstimate:
    """:func:`estimate_training_memory`, remembered per (config, shape, settings) for this process, so the
    callbacks that ask the same question (``ConfigChecks``, ``CachePreallocator``) trace once."""
    key = (model_config.to_json_string(), rows, length, tuple(keys), normalize_precision(precision), device,
           attn_implementation, gradient_checkpointing)
    if key not in _ESTIMATES:
        _ESTIMATES[key] = estimate_training_memory(model_config, rows, length, keys, precision, device,
                                                   attn_implementation, gradient_checkpointing)
    return _ESTIMATES[key]


def module_facts(pl_module: torch.nn.Module) -> dict[str, Any] | None:
    """``model_config``, ``attn_implementation`` and ``gradient_checkpointing`` of a LightningModule wrapping a
    Hugging Face model as ``.model`` (like ``CausalLM``); ``None`` for anything else (nothing to trace)."""
    model = getattr(pl_module, "model", None)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string") or not hasattr(config, "vocab_size"):
        return None
    return {"model_config": config, "attn_implementation": getattr(config, "_attn_implementation", None) or "sdpa",
            "gradient_checkpointing": bool(getattr(model, "is_activation_checkpointing", None)
                                           if hasattr(model, "is_activation_checkpointing")
                                           else getattr(model, "is_gradient_checkpointing", False))}


def sharded(est: MemoryEstimate, shards: int) -> MemoryEstimate:
    """``est`` on one of ``shards`` ranks that split weights, gradients and optimizer state (FSDP full shard)."""
    if shards <= 1:
        return est
    split = {name: getattr(est, name) // shards for name in ("parameters", "gradients", "optimizer_state")}
    peak = est.peak - sum(getattr(est, name) - value for name, value in split.items())
    return replace(est, peak=peak, **split)


def shortfall_message(
    model_config,
    shape: tuple[int, int],
    keys: Sequence[str],
    available: int,
    precision: str = "32-true",
    attn_implementation: str = "sdpa",
    gradient_checkpointing: bool = False,
    device: str = "cuda",
    shards: int = 1,
) -> str | None:
    """When the traced peak of a ``shape`` training step exceeds ``available`` bytes: a message with the peak, its
    split and the largest ``micro_batch_size`` (rows) that fits; ``None`` when it fits.

    Args:
        model_config: the ``transformers`` config of the model.
        shape: the worst-case ``(rows, length)``.
        keys: the batch keys.
        available: bytes the step may use (free device memory plus what the model already holds there).
        precision, attn_implementation, gradient_checkpointing, device: as in :func:`estimate_training_memory`.
        shards: ranks that share weights, gradients and optimizer state (FSDP's world size): each holds a
            ``1/shards`` part of them (the gathered layer in flight is not counted).
    """
    from lightning_seqmem.memory.stats import format_bytes

    rows, length = shape
    settings = (keys, precision, device, attn_implementation, gradient_checkpointing)
    def estimate(r: int) -> MemoryEstimate:
        return sharded(cached_estimate(model_config, r, length, *settings), shards)

    est = estimate(rows)
    if est.peak <= available:
        return None
    smaller = [2**i for i in range(rows.bit_length()) if 2**i < rows]
    best, _ = largest_fitting(estimate, available, smaller)
    fix = (f"micro_batch_size={best} fits" if best is not None else
           "not even micro_batch_size=1 fits: use gradient checkpointing, a shorter max_length or bf16")
    return (f"Predicted peak training memory for the worst-case batch {rows} x {length} is {format_bytes(est.peak)} "
            f"(parameters {format_bytes(est.parameters)}, gradients {format_bytes(est.gradients)}, optimizer state "
            f"{format_bytes(est.optimizer_state)}, activations {format_bytes(est.activations)}; traced, "
            f"{precision}, {attn_implementation}), more than the {format_bytes(available)} available: {fix}. "
            "seqmem-plan prints the whole table.")
