"""Building the Hugging Face model ``CausalLM`` wraps: presets, configs, weights, and its positions checked.

The presets are small named configs built with random weights (no download); a dict with ``model_type`` and config
fields builds any other architecture, and a local ``save_pretrained`` directory loads trained weights. What the
module does after building (checkpointing, ``compile``) and the check that the DataModule's rows fit the model's
positions are here too, so ``CausalLM`` only wires them. Torch and transformers only (no Lightning).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import torch

from lightning_seqmem.messages import short_repr
from lightning_seqmem.protocols import GivesMaxBatchShape
from lightning_seqmem.training.adapter_checkpoints import admit_rebuilt_base
from lightning_seqmem.training.adapters import (
    NON_REENTRANT,
    LoraSettings,
    apply_lora,
    quantized_load_kwargs,
    resolve_lora,
)
from lightning_seqmem.training.attention import AUTO, register_varlen_attention
from lightning_seqmem.training.varlen import TORCH_VARLEN

# Named model configs built with random weights (no download). A few million parameters each.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny_llama": dict(
        model_type="llama",
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    ),
    "tiny_gpt2": dict(
        model_type="gpt2",
        n_embd=192,
        n_layer=4,
        n_head=6,
        n_positions=4096,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
}


def build_model_config(model_config: str | dict[str, Any], vocab_size: int, pad_token_id: int | None):
    """A ``transformers`` config from a preset name or a dict with ``model_type`` and config fields."""
    from transformers import AutoConfig

    if isinstance(model_config, str):
        if model_config not in MODEL_PRESETS:
            raise ValueError(
                f"Unknown model_config {short_repr(model_config)}; choose one of {sorted(MODEL_PRESETS)}, pass a "
                "dict with "
                "'model_type' and config fields, or pass pretrained_path=<local directory>."
            )
        fields = dict(MODEL_PRESETS[model_config])
    else:
        fields = dict(model_config)
    if "model_type" not in fields:
        raise ValueError(f"model_config needs a 'model_type' key (e.g. 'llama', 'gpt2'); got keys {sorted(fields)}.")
    model_type = fields.pop("model_type")
    fields.setdefault("vocab_size", vocab_size)
    if pad_token_id is not None:
        fields.setdefault("pad_token_id", pad_token_id)
    fields.update(_quiet_defaults(model_type, fields))
    return AutoConfig.for_model(model_type, **fields)


def _quiet_defaults(model_type: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Defaults of the config class that do not fit a model built from scratch, set right so transformers does
    not warn about them: a ``bos_token_id``/``eos_token_id`` outside this vocabulary (GPT-2's 50256 in a 4,096-token
    one) becomes ``None`` (the tokenizer's own ids are the data's business: we train with labels, not by them). A
    value the caller gave is kept."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return {}  # AutoConfig.for_model names the unknown type
    defaults = CONFIG_MAPPING[model_type]()
    vocab = fields.get("vocab_size", getattr(defaults, "vocab_size", None))
    out: dict[str, Any] = {}
    for name in ("bos_token_id", "eos_token_id"):
        value = getattr(defaults, name, None)
        if name not in fields and isinstance(value, int) and isinstance(vocab, int) and not 0 <= value < vocab:
            out[name] = None
    return out


def build_causal_lm(
    model_config: str | dict[str, Any],
    pretrained_path: str | None,
    vocab_size: int | None,
    pad_token_id: int | None,
    attn_implementation: str,
    gradient_checkpointing: bool = False,
    compile: bool | Mapping[str, Any] = False,
    lora: LoraSettings | Mapping[str, Any] | None = None,
) -> torch.nn.Module:
    """The Hugging Face causal LM of ``CausalLM``'s arguments (see its docstring for each).

    ``attn_implementation="auto"`` is built as SDPA and decided at ``setup``, once the device and precision are
    known; ``"torch_varlen"`` is registered with transformers here (its device is checked at ``setup``, and by the
    kernel call without a Trainer). A pretrained model with fewer embeddings than ``vocab_size`` is resized. With
    ``lora`` the model is PEFT's, the adapter on the base (:func:`~lightning_seqmem.training.adapters.apply_lora`),
    added after checkpointing is switched on and before compiling; QLoRA loads the pretrained base in 4-bit.
    """
    from transformers import AutoModelForCausalLM

    attn = "sdpa" if attn_implementation == AUTO else attn_implementation
    if attn == TORCH_VARLEN:
        register_varlen_attention()
    lora = resolve_lora(lora, pretrained_path)
    if pretrained_path is not None:
        quantized = quantized_load_kwargs(lora) if lora is not None and lora.quantize is not None else {}
        model = AutoModelForCausalLM.from_pretrained(
            pretrained_path, local_files_only=True, attn_implementation=attn, **quantized
        )
        if vocab_size is not None and model.get_input_embeddings().num_embeddings < vocab_size:
            model.resize_token_embeddings(vocab_size)
        model.train()  # from_pretrained returns it in eval mode (no dropout), and Lightning keeps module modes
    else:
        config = build_model_config(model_config, vocab_size, pad_token_id)
        config._attn_implementation = attn
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    if getattr(model, "loss_type", "") is None:  # a class name transformers does not map (GPT2LMHeadModel)
        model.loss_type = "ForCausalLM"  # the loss it falls back to, with a warning, at the first step
    if gradient_checkpointing:
        enable_checkpointing(model)
    if lora is not None:
        model = apply_lora(model, lora)
        if pretrained_path is not None:  # a checkpoint may leave this base out: it is loaded from there again
            admit_rebuilt_base(model)
    options = compile_options(compile)
    if options is not None:
        model.compile(**options)  # in place (nn.Module.compile): parameter names and checkpoints unchanged
    return model


COMPILE_KEYS = ("backend", "mode", "dynamic", "fullgraph", "options")
"""The ``torch.compile`` arguments ``CausalLM(compile={...})`` passes on."""


def compile_options(compile: bool | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``CausalLM``'s ``compile`` as ``torch.compile``'s keyword arguments; ``None``: not compiled.

    ``True`` compiles with torch's defaults (inductor); a mapping chooses among :data:`COMPILE_KEYS` (a mode such
    as ``"max-autotune"``, another backend, ``dynamic``), so a run can tune its compile from a config without
    subclassing. An empty mapping is torch's defaults too (unlike ``False``).
    """
    if compile is None or compile is False:
        return None
    if compile is True:
        return {}
    if not isinstance(compile, Mapping):
        raise ValueError(
            f"compile={compile!r}: give True, False, or torch.compile's arguments as a mapping, e.g. "
            "compile={'mode': 'max-autotune'} (model.compile='{mode: max-autotune}' in Hydra)."
        )
    unknown = sorted(set(map(str, compile)) - set(COMPILE_KEYS))
    if unknown:
        raise ValueError(
            f"compile has {', '.join(map(repr, unknown))}, which torch.compile's in-place form does not take here: "
            f"use {', '.join(COMPILE_KEYS)}."
        )
    return {str(k): v for k, v in compile.items()}


def enable_checkpointing(model) -> None:
    """Recompute each layer in backward, non-reentrant (torch's recommended mode, the one the memory estimate
    traces). transformers 5 renamed the method; the older name warns."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=dict(NON_REENTRANT))
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(NON_REENTRANT))


# ------------------------------------------------------------------------------------------------- positions
def max_positions(config: Any) -> tuple[str, int] | None:
    """``(field, value)``: the number of positions a transformers config declares (``max_position_embeddings`` or
    ``n_positions``), or ``None``."""
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return getattr(config, "attribute_map", {}).get(name, name), value  # GPT-2 aliases it to n_positions
    return None


def has_learned_positions(model: torch.nn.Module, limit: int) -> bool:
    """Whether the model looks positions up in a table of ``limit`` rows (GPT-2's ``wpe``): a longer row is an
    IndexError, not just an untrained position."""
    inputs = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return any(
        isinstance(m, torch.nn.Embedding) and m is not inputs and m.num_embeddings == limit for m in model.modules()
    )


def datamodule_max_length(dm: Any) -> int | None:
    """The longest row a DataModule yields: ``max_batch_shape()[1]`` when it has one, else its ``max_length``."""
    if isinstance(dm, GivesMaxBatchShape):
        return int(dm.max_batch_shape()[1])
    length = getattr(dm, "max_length", None)
    return int(length) if isinstance(length, numbers.Integral) and not isinstance(length, bool) else None


def positions_problem(model: torch.nn.Module, length: int | None) -> tuple[str, bool] | None:
    """``(message, fatal)`` when rows of ``length`` tokens exceed the model's positions, else ``None``.

    Fatal for a learned position table (a torch IndexError at the first long row); otherwise the model runs past
    the positions it was configured (or trained) for, which deserves a warning only.
    """
    field = max_positions(model.config)
    if field is None or length is None or length <= field[1]:
        return None
    name, limit = field
    message = (
        f"The DataModule yields rows of up to {length} tokens but the model has {limit} positions "
        f"({type(model.config).__name__}.{name}={limit}). Fix one of: lower the DataModule's max_length to "
        f"{limit} or less, or use a model config with {name} >= {length}."
    )
    if has_learned_positions(model, limit):
        return message, True
    return message + " (The model runs past the limit, on positions it was not configured for.)", False
