"""What the memory callbacks need to know about a LightningModule's model, read in one place.

``CachePreallocator`` (token ids below the vocabulary), the memory estimate (the ``transformers`` config, attention
and checkpointing to trace) and ``ConfigChecks`` (attention implementation, ``torch.compile``) accept any
LightningModule, so they cannot ask it through a protocol of ours: a user's module is duck-typed, and this module is
the one place that does it. ``CausalLM`` answers everything; a module of your own answers what it has (a Hugging
Face model as ``.model``, ``vocab_size`` / ``attn_implementation`` / ``compile`` attributes or hyperparameters), and
each unknown fact is ``None`` or ``False``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_seqmem.training.adapters import LoraSettings, settings_of
from lightning_seqmem.training.linear_cross_entropy import DEFAULT_CHUNK_SIZE
from lightning_seqmem.training.loss_layer import CROSS_ENTROPY


@dataclass(frozen=True)
class ModelFacts:
    """Facts about a LightningModule's model; ``None`` where the module does not say.

    Attributes:
        config: the ``transformers`` config of ``pl_module.model`` (a config with ``to_json_string`` and
            ``vocab_size``: what the memory tracer needs), ``None`` without a Hugging Face model.
        vocab_size: a positive int from the model's config, else ``hparams.vocab_size``, else ``pl_module.vocab_size``.
        attn_implementation: the model config's ``_attn_implementation`` (what runs), else the module's
            ``attn_implementation`` attribute or hyperparameter (what was asked for).
        gradient_checkpointing: the Hugging Face model recomputes its layers in backward.
        compiled: the module or a submodule is compiled (``torch.compile``, ``nn.Module.compile``, Lightning's
            ``from_compiled``), or its hyperparameters ask for it (``compile=True``).
        cross_entropy: the loss layer that runs: the module's ``loss_layer`` (``CausalLM``: ``cross_entropy`` with
            ``"auto"`` decided), else its ``cross_entropy`` hyperparameter, else ``"full"`` (the model's own loss).
        loss_chunk_size: tokens per chunk of a chunked loss (``hparams.loss_chunk_size``), else the kernel's default.
        lora: the LoRA settings of a PEFT-wrapped model (``CausalLM(lora=...)`` or ``peft.get_peft_model``), else
            ``None``.
        traceable_adapter: ``False`` for an adapter the memory tracer cannot rebuild (another PEFT method than plain
            LoRA; LoRA on a 4-bit base is traced on :mod:`~lightning_seqmem.memory.qlora_shape`'s stand-in).
    """

    config: Any = None
    vocab_size: int | None = None
    attn_implementation: str | None = None
    gradient_checkpointing: bool = False
    compiled: bool = False
    cross_entropy: str = "full"
    loss_chunk_size: int = DEFAULT_CHUNK_SIZE
    lora: LoraSettings | None = None
    traceable_adapter: bool = True


def model_facts(pl_module: torch.nn.Module) -> ModelFacts:
    """Read :class:`ModelFacts` from any LightningModule (or ``nn.Module``); missing attributes are unknown.

    Example::

        facts = model_facts(CausalLM(model_config="tiny_llama", vocab_size=32000))
        facts.vocab_size, facts.attn_implementation  # (32000, 'sdpa')
    """
    model = getattr(pl_module, "model", None)
    config = getattr(model, "config", None)
    hparams = getattr(pl_module, "hparams", None)
    try:
        lora, traceable = settings_of(model), True
    except ValueError:  # a PEFT method other than plain LoRA
        lora, traceable = None, False
    return ModelFacts(
        config=config if hasattr(config, "to_json_string") and hasattr(config, "vocab_size") else None,
        vocab_size=_first("vocab_size", (config, hparams, pl_module), _positive_int),
        attn_implementation=(
            _first("_attn_implementation", (config,), _string)
            or _first("attn_implementation", (pl_module, hparams), _string)
        ),
        gradient_checkpointing=_checkpointing(model),
        compiled=_compiled(pl_module, hparams),
        cross_entropy=_loss_layer(pl_module, hparams, model),
        loss_chunk_size=_first("loss_chunk_size", (hparams,), _positive_int) or DEFAULT_CHUNK_SIZE,
        lora=lora,
        traceable_adapter=traceable,
    )


def _loss_layer(pl_module: torch.nn.Module, hparams: object, model: object) -> str:
    """The module's resolved loss layer when it has one (read only once its model exists), else its hyperparameter."""
    if model is not None and isinstance(getattr(type(pl_module), "loss_layer", None), property):
        return pl_module.loss_layer
    return _first("cross_entropy", (hparams,), lambda v: v in CROSS_ENTROPY) or "full"


def _first(name: str, owners: tuple[object, ...], accept: Callable[[object], bool]) -> Any:
    """The first accepted ``name`` among ``owners``: an attribute, or a key of a mapping such as ``hparams``."""
    for owner in owners:
        value = owner.get(name) if isinstance(owner, Mapping) else getattr(owner, name, None)
        if accept(value):
            return value
    return None


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _string(value: object) -> bool:
    return isinstance(value, str)


def _checkpointing(model: object) -> bool:
    """transformers 5 renamed ``is_gradient_checkpointing`` to ``is_activation_checkpointing``."""
    if hasattr(model, "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def _compiled(pl_module: torch.nn.Module, hparams: object) -> bool:
    asked = isinstance(hparams, Mapping) and hparams.get("compile") not in (None, False)
    if getattr(pl_module, "_compiler_ctx", None) or asked:
        return True  # Lightning's from_compiled, or CausalLM(compile=True or torch.compile's arguments)
    return any(
        getattr(module, "_compiled_call_impl", None) is not None or type(module).__name__ == "OptimizedModule"
        for module in pl_module.modules()
    )
