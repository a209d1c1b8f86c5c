"""The memory estimate of a deep decoder from traces of one and two of its layers, exact for layers that are alike.

Tracing a training step of a 32-layer 8 B model on fake tensors takes tens of seconds; a planner that compares many
configurations cannot wait that long for each. A decoder's layers are alike (same shapes, same ops), so every live
byte at any moment of the step is a constant (embeddings, head, batch, loss layer) plus a whole number of layers'
worth of something (their weights, gradients, optimizer state, saved activations). The trace is cut into segments
where that count is a fixed linear function of the layer count ``L``:

- per step and phase (forward, backward, optimizer), the part before the first layer runs, the part after the
  last one, and the part inside the **first** and the **last** layer (layer ``k``'s moments hold ``A + B k + C L``
  bytes, largest at ``k = 1`` or ``k = L``: the layers in between never hold the peak);
- in forward the layers run first to last, in backward last to first (a layer's backward starts when the gradient
  of its output exists: a tensor hook), the optimizer step is one segment (its tensors are per parameter, so a
  whole number of layers too).

Each segment's peak (and what is alive at it, by category) is traced at ``L = 1`` (the one layer is both first and
last) and ``L = 2``, extended on its line to the model's layer count, and the largest is the peak. ``tests/
test_plan_search.py`` checks that this equals the full trace of a 4-layer model, plain, checkpointed and with the
chunked loss. Models whose layers differ (``layer_types`` that are not all the same, no layer list found) are
traced whole.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from typing import Any

import torch

from lightning_seqmem.memory.adapter_trace import add_fake_lora
from lightning_seqmem.memory.estimate import MemoryEstimate, checked_arguments, estimate_training_memory
from lightning_seqmem.memory.fake_model import build_fake_model
from lightning_seqmem.memory.optimizer_8bit import traced_optimizer
from lightning_seqmem.memory.qlora_shape import quantize_linears
from lightning_seqmem.memory.trace import (
    CATEGORIES,
    CUDA_GRANULE,
    LiveBytes,
    steady_state,
    trace_errors,
    trace_training_steps,
)
from lightning_seqmem.memory.worst_batch import make_dummy_batch
from lightning_seqmem.training.linear_cross_entropy import DEFAULT_CHUNK_SIZE

LAYER_LISTS = ("layers", "h", "blocks", "layer")  # the names transformers gives a decoder's list of layers
TRACED_LAYERS = (1, 2)


class _Segment:
    __slots__ = ("phase", "peak", "rising", "snapshot")

    def __init__(self, phase: str) -> None:
        self.phase, self.peak, self.rising, self.snapshot = phase, 0, False, None


class LayerSegments(LiveBytes):
    """:class:`~lightning_seqmem.memory.trace.LiveBytes` that also keeps the peak of each segment of the step
    (``(step, phase, region)``; region ``"before"``, ``"first"``, ``"middle"``, ``"last"`` or ``"after"`` the
    layers, told by :func:`watch_layers`) and what was alive at it."""

    def __init__(self, granule: int = 1) -> None:
        self.step, self.segments, self._current, self._phase = 0, {}, [], "setup"
        super().__init__(granule)
        self.enter(("before",))

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase = value
        if value == "forward":
            self.step += 1
        if hasattr(self, "_live"):
            self.enter(("before",))

    def enter(self, regions: Sequence[str]) -> None:
        """From now on the step is in ``regions`` (two at once for the only layer of a one-layer model)."""
        self._settle()
        self._current = [
            self.segments.setdefault((self.step, self._phase, region), _Segment(self._phase)) for region in regions
        ]
        self._touch()

    def _settle(self) -> None:
        snapshot = None
        for segment in self._current:
            if segment.rising:  # only allocations since its peak: what is alive now was alive then
                snapshot = list(self._live.values()) if snapshot is None else snapshot
                segment.snapshot, segment.rising = snapshot, False

    def _touch(self) -> None:
        for segment in self._current:
            if self.total > segment.peak:
                segment.peak, segment.rising = self.total, True

    def add(self, tensor: torch.Tensor, category: str = "activations") -> None:
        super().add(tensor, category)
        self._touch()

    def _free(self, key: int) -> None:
        if key in self._live:
            self._settle()
        super()._free(key)

    def segment_split(self) -> dict[tuple, dict[str, Any]]:
        """Per segment: its peak, phase, bytes per category and the loss layer's bytes at that peak."""
        self._settle()
        out = {}
        for key, segment in self.segments.items():
            split = dict.fromkeys(CATEGORIES, 0)
            records = segment.snapshot or []
            for record in records:
                split[record.category] += record.nbytes
            loss = sum(r.nbytes for r in records if r.loss_layer and r.category == "activations")
            out[key] = {"peak": segment.peak, "phase": segment.phase, "split": split, "loss_layer": loss}
        return out


def layer_count(model_config) -> int | None:
    """The decoder's number of layers (``num_hidden_layers``, or its alias in the config), or ``None``."""
    value = getattr(model_config, "num_hidden_layers", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def with_layers(model_config, layers: int):
    """A copy of ``model_config`` with ``layers`` decoder layers, or ``None`` when its layers are not all alike."""
    types = getattr(model_config, "layer_types", None)
    if types is not None and len(set(types)) > 1:
        return None  # sliding and full attention mixed: layers differ
    config = copy.deepcopy(model_config)
    config.num_hidden_layers = layers
    if types is not None:
        config.layer_types = list(types)[:layers]
    return config


def decoder_layers(model: torch.nn.Module, layers: int) -> torch.nn.ModuleList | None:
    """The model's list of ``layers`` decoder layers (``model.layers``, ``transformer.h`` ...), or ``None``."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == layers and name.rsplit(".", 1)[-1] in LAYER_LISTS:
            return module
    return None


def watch_layers(layers: torch.nn.ModuleList, tracker: LayerSegments) -> list:
    """Tell ``tracker`` which layer runs: forward (pre-)hooks in forward, tensor hooks on each layer's output (its
    backward starts) and on the first layer's input (the layers' backward is over). Returns the hook handles."""
    count, handles = len(layers), []

    def hidden_of(value: Any) -> torch.Tensor | None:
        value = value[0] if isinstance(value, (tuple, list)) and value else value
        return value if isinstance(value, torch.Tensor) and value.requires_grad else None

    for index, layer in enumerate(layers):
        regions = tuple(r for r, on in (("first", index == 0), ("last", index == count - 1)) if on) or ("middle",)

        def before(module, args, kwargs, index=index, regions=regions):
            if tracker.phase != "forward":
                return  # checkpointing's recomputation in backward: still the layer's backward
            tracker.enter(regions)
            hidden = hidden_of(args) if args else hidden_of(kwargs.get("hidden_states"))
            if index == 0 and hidden is not None:
                hidden.register_hook(lambda grad: tracker.enter(("after",)))

        def after(module, args, output, index=index, regions=regions):
            if tracker.phase != "forward":
                return
            hidden = hidden_of(output)
            if hidden is not None:
                hidden.register_hook(lambda grad, regions=regions: tracker.enter(regions))
            if index == count - 1:
                tracker.enter(("after",))

        handles.append(layer.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(layer.register_forward_hook(after))
    return handles


def _trace_segments(
    model_config, rows, length, keys, precision, device, attn_implementation, checkpointing, loss, lora, optimizer
):
    """Segment peaks, final live bytes and parameter count of a training step of ``model_config`` (few layers)."""
    mode, module = build_fake_model(model_config, attn_implementation, precision, checkpointing)
    if lora is not None:
        module = add_fake_lora(mode, module, lora, precision)
    layers = decoder_layers(module, layer_count(model_config))
    if layers is None:
        return None
    tracker = LayerSegments(CUDA_GRANULE if device == "cuda" else 1)
    handles = watch_layers(layers, tracker)
    batch = make_dummy_batch(rows, length, keys, int(model_config.vocab_size))
    try:
        with trace_errors(model_config), mode:
            optimizer = traced_optimizer(module, device, optimizer)
            steady_state(module, optimizer, tracker)
            trace_training_steps(module, optimizer, batch, precision, 1, tracker.granule, *loss, tracker=tracker)
    finally:
        for handle in handles:
            handle.remove()
    state = tracker.live_split()
    del state["activations"]
    return {
        "segments": tracker.segment_split(),
        "state": state,
        "parameters": sum(p.numel() for p in module.parameters()),
    }


def _line(one: int, two: int, layers: int) -> int:
    return one + (layers - 1) * (two - one)


def scaled_training_memory(
    model_config,
    rows: int,
    length: int,
    keys: Sequence[str] = ("input_ids", "attention_mask", "labels"),
    precision: str = "32-true",
    device: str = "cuda",
    attn_implementation: str = "sdpa",
    gradient_checkpointing: bool = False,
    cross_entropy: str = "full",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    lora: Any = None,
    optimizer: str = "adamw",
) -> MemoryEstimate:
    """:func:`~lightning_seqmem.memory.estimate.estimate_training_memory` of ``model_config``, traced at one and two
    layers and extended to its layer count (see the module docstring); the whole model is traced when it has two
    layers or fewer or its layers are not alike. Same arguments, same result."""
    layers = layer_count(model_config)
    small = [with_layers(model_config, n) for n in TRACED_LAYERS] if layers and layers > max(TRACED_LAYERS) else []
    args = (keys, precision, device, attn_implementation, gradient_checkpointing)
    whole = lambda: estimate_training_memory(  # noqa: E731
        model_config,
        rows,
        length,
        *args,
        cross_entropy=cross_entropy,
        chunk_size=chunk_size,
        lora=lora,
        optimizer=optimizer,
    )
    if not small or None in small:
        return whole()
    precision, decided = checked_arguments(model_config, rows, length, device, precision, cross_entropy, chunk_size)
    loss = ("chunked" if decided == "liger" else decided, chunk_size)
    traced = []
    for config in small:
        traced.append(
            _trace_segments(
                config, rows, length, keys, precision, device, attn_implementation, args[-1], loss, lora, optimizer
            )
        )
        if traced[-1] is None:
            return whole()
    one, two = traced
    segments = []
    for key, a in one["segments"].items():
        b = two["segments"].get(key)
        if b is None:
            return whole()
        split = {c: _line(a["split"][c], b["split"][c], layers) for c in CATEGORIES}
        peak = _line(a["peak"], b["peak"], layers)
        segments.append((peak, a["phase"], split, _line(a["loss_layer"], b["loss_layer"], layers)))
    peak, phase, split, loss_layer = max(segments, key=lambda s: s[0])  # the first of equal peaks, as traced
    return MemoryEstimate(
        rows=rows,
        length=length,
        device=device,
        precision=precision,
        attn_implementation=attn_implementation,
        gradient_checkpointing=gradient_checkpointing,
        peak=peak,
        peak_phase=phase,
        num_parameters=_line(one["parameters"], two["parameters"], layers),
        state={c: _line(one["state"][c], two["state"][c], layers) for c in one["state"]},
        cross_entropy=decided,
        loss_layer=loss_layer,
        **split,
    )


_SCALED: dict[tuple, MemoryEstimate] = {}


def cached_scaled(model_config, *args, **kwargs) -> MemoryEstimate:
    """:func:`scaled_training_memory`, remembered per (config, shape, settings) for this process: the same question
    however its arguments are spelled (positional or by name, defaults left out or given) is traced once."""
    bound = inspect.signature(scaled_training_memory).bind(model_config, *args, **kwargs)
    bound.apply_defaults()
    settings = {
        **bound.arguments,
        "model_config": model_config.to_json_string(),
        "keys": tuple(bound.arguments["keys"]),
    }
    key = tuple(settings.items())
    if key not in _SCALED:
        _SCALED[key] = scaled_training_memory(model_config, *args, **kwargs)
    return _SCALED[key]


_COUNTS: dict[str, tuple[int, int, int]] = {}


def parameter_counts(model_config) -> tuple[int, int, int]:
    """``(parameters, parameter tensors, parameters per decoder layer)`` of ``model_config``, counted on fake models
    of one and two layers (nothing allocated) and extended to its layer count; the whole model when it is not made
    of alike layers (per layer then 0)."""
    key = model_config.to_json_string()
    if key not in _COUNTS:
        layers = layer_count(model_config) or 0
        small = [with_layers(model_config, n) for n in TRACED_LAYERS]
        if layers <= max(TRACED_LAYERS) or None in small:
            model = build_fake_model(model_config)[1]
            params = list(model.parameters())
            _COUNTS[key] = (sum(p.numel() for p in params), len(params), 0)
        else:
            counts = []
            for config in small:
                params = list(build_fake_model(config)[1].parameters())
                counts.append((sum(p.numel() for p in params), len(params)))
            (n1, t1), (n2, t2) = counts
            _COUNTS[key] = (_line(n1, n2, layers), _line(t1, t2, layers), n2 - n1)
    return _COUNTS[key]


_QUANTIZED: dict[tuple[str, str], int] = {}


def quantized_weight_bytes(model_config, precision: str) -> int:
    """Bytes of ``model_config``'s weights with its linear layers but the head in 4-bit
    (:func:`~lightning_seqmem.memory.qlora_shape.quantize_linears`, QLoRA's base) and the rest in ``precision``'s
    parameter dtype: counted on fake models of one and two layers and extended to its layer count (the whole model
    when its layers are not alike)."""
    key = (model_config.to_json_string(), precision)
    if key not in _QUANTIZED:

        def count(config) -> int:
            mode, model = build_fake_model(config, precision=precision)
            with mode:
                quantize_linears(model)
            return sum(p.numel() * p.element_size() for p in model.parameters())

        layers = layer_count(model_config) or 0
        small = [with_layers(model_config, n) for n in TRACED_LAYERS]
        if layers <= max(TRACED_LAYERS) or None in small:
            _QUANTIZED[key] = count(model_config)
        else:
            _QUANTIZED[key] = _line(count(small[0]), count(small[1]), layers)
    return _QUANTIZED[key]
