"""Adapters through PEFT: LoRA on a Hugging Face causal LM, QLoRA on a 4-bit (NF4) base, the adapter saved and merged.

PEFT (Hugging Face's library, an optional extra: ``pip install lightning_seqmem[peft]``) does the work: the base
model's linear layers get low-rank ``lora_A``/``lora_B`` beside them and only those train. This module turns the
``lora`` option (:class:`LoraSettings`, from a dict, checked key by key) into PEFT's ``LoraConfig``, checks that the
named target modules exist, and answers what the rest of the bundle asks of an adapted model: its trainable
parameters, its adapter saved in PEFT's own format (``PeftModel.from_pretrained`` loads it), the adapter merged into
the base (what a checkpoint keeps of it: ``adapter_checkpoints``). QLoRA (``quantize="nf4"``) loads the base through
bitsandbytes, which runs on CUDA only: it is refused elsewhere with the fix. Torch, transformers and PEFT only (no
Lightning).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from lightning_seqmem.messages import short_repr
from lightning_seqmem.training.checks import require_bitsandbytes

ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output head
BIASES = ("none", "all", "lora_only")
QUANTIZE = (None, "nf4")
PEFT_INSTALL = "pip install lightning_seqmem[peft]"


@dataclass(frozen=True)
class LoraSettings:
    """A LoRA adapter, as ``CausalLM(lora=dict(...))`` gives it (each field checked here, named in the error).

    Args:
        r: the adapter's rank (an int >= 1): ``lora_A`` is ``[r, in]``, ``lora_B`` ``[out, r]``.
        alpha: the scale numerator: the adapter's update is multiplied by ``alpha / r`` (a number > 0).
        dropout: dropout on the adapter's input, in ``[0, 1)``.
        target_modules: ``"all-linear"`` (every linear layer but the LM head, PEFT's default for QLoRA) or the
            names of the modules to adapt (``["q_proj", "v_proj"]``: matched against the last part of each
            module's name); a name the model lacks is an error, never a silently smaller adapter.
        bias: which biases train: ``"none"``, ``"all"`` or ``"lora_only"`` (PEFT's choices).
        quantize: ``None`` (the base in the training precision) or ``"nf4"``: QLoRA, the base in 4-bit NormalFloat
            through bitsandbytes (CUDA only), the adapter in full precision on top.

    Example::

        LoraSettings.from_value(dict(r=16, alpha=32, target_modules=["q_proj", "v_proj"]))
    """

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    target_modules: str | tuple[str, ...] = ALL_LINEAR
    bias: str = "none"
    quantize: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"lora.r={self.r!r} is not valid: the adapter's rank, an int >= 1 (e.g. lora.r=16).")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or self.alpha <= 0:
            raise ValueError(f"lora.alpha={self.alpha!r} is not valid: a number > 0 (often 2 * r, e.g. 32).")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout={self.dropout!r} is not valid: a number in [0, 1) (e.g. 0.05).")
        object.__setattr__(self, "target_modules", _target_names(self.target_modules))
        if self.bias not in BIASES:
            raise ValueError(f"lora.bias={self.bias!r} is not valid; use one of {BIASES}.")
        if self.quantize not in QUANTIZE:
            raise ValueError(
                f"lora.quantize={self.quantize!r} is not valid; use None (LoRA on the base as it is) or 'nf4' "
                "(QLoRA: a 4-bit base through bitsandbytes, CUDA only)."
            )

    @classmethod
    def from_value(cls, value: Any) -> LoraSettings | None:
        """``None`` (no adapter), a ``LoraSettings``, or a mapping of its fields (a dict, Hydra's ``DictConfig``):
        an unknown key is refused by name with the keys there are."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(
                f"lora={short_repr(value)} is not valid: give a dict of LoRA settings, e.g. lora=dict(r=16, alpha=32), "
                "or None for full fine-tuning."
            )
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(key) for key in value if key not in known)
        if unknown:
            raise ValueError(f"lora has unknown key(s) {unknown}; the LoRA settings are {known}.")
        return cls(**{str(key): _plain(item) for key, item in value.items()})

    def peft_config(self) -> Any:
        """PEFT's ``LoraConfig`` for a causal LM with these settings."""
        peft = import_peft()
        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return peft.LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=float(self.dropout),
            target_modules=targets,
            bias=self.bias,
            task_type="CAUSAL_LM",
        )


def resolve_lora(value: Any, pretrained_path: str | None = None) -> LoraSettings | None:
    """``CausalLM``'s ``lora`` argument as settings (:meth:`LoraSettings.from_value`), checked against where the base
    comes from: QLoRA quantizes pretrained weights, so ``quantize="nf4"`` needs ``pretrained_path``."""
    settings = LoraSettings.from_value(value)
    if settings is not None and settings.quantize is not None and pretrained_path is None:
        raise ValueError(
            f"lora.quantize={settings.quantize!r} (QLoRA) quantizes pretrained weights: give pretrained_path=<local "
            "directory>, or use lora.quantize=None on a model built from model_config."
        )
    return settings


def _plain(value: Any) -> Any:
    """Hydra's ``ListConfig`` (any non-string sequence) as a tuple; other values as they are."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        return tuple(value)
    return value


def _target_names(value: Any) -> str | tuple[str, ...]:
    if isinstance(value, str):
        if not value:
            raise ValueError("lora.target_modules='' is not valid: use 'all-linear' or a list of module names.")
        return value if value == ALL_LINEAR else (value,)
    if isinstance(value, Sequence) and value and all(isinstance(name, str) and name for name in value):
        return tuple(value)
    raise ValueError(
        f"lora.target_modules={short_repr(list(value) if isinstance(value, tuple) else value)} is not valid: use "
        "'all-linear' or a non-empty list of module names "
        "(e.g. ['q_proj', 'v_proj'])."
    )


# ---------------------------------------------------------------------------------------------------- PEFT
def import_peft() -> Any:
    """The ``peft`` package, or an ``ImportError`` that says how to install it."""
    try:
        import peft
    except ImportError:
        raise ImportError(f"LoRA adapters need PEFT: `{PEFT_INSTALL}` (or `pip install peft`).") from None
    return peft


def is_peft_model(module: Any) -> bool:
    """Whether ``module`` is a PEFT model (``get_peft_model``'s or ``PeftModel.from_pretrained``'s), without
    importing PEFT when nothing has (a model cannot be one then)."""
    import sys

    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def find_peft_model(module: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """``(name, peft_model)``: the first PEFT model among ``module`` and its submodules (a user's LightningModule
    holding one under any attribute), ``name`` its prefix in ``module.state_dict()`` (``""`` for itself)."""
    for name, child in module.named_modules():
        if is_peft_model(child):
            return name, child
    return None


def settings_of(model: torch.nn.Module) -> LoraSettings | None:
    """The :class:`LoraSettings` of a PEFT model's active LoRA adapter, as ``get_peft_model`` was given them
    (``target_modules`` as PEFT resolved them: the names it adapted), ``quantize="nf4"`` on a 4-bit base; ``None``
    for a model without PEFT.

    Raises:
        ValueError: a PEFT method other than plain LoRA (prompt tuning, IA3, DoRA, per-layer ranks...), which
            nothing here can rebuild.
    """
    if not is_peft_model(model):
        return None
    config = model.active_peft_config
    kind = str(getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", None)))
    extras = [
        name for name in ("rank_pattern", "alpha_pattern", "use_dora", "modules_to_save") if getattr(config, name, None)
    ]
    if kind != "LORA" or extras:
        raise ValueError(
            f"a PEFT adapter of type {kind} with {extras or 'no'} extras: only plain LoRA is supported here."
        )
    targets = config.target_modules
    return LoraSettings(
        r=int(config.r),
        alpha=config.lora_alpha,
        dropout=float(config.lora_dropout),
        target_modules=targets if isinstance(targets, str) else tuple(sorted(targets)),
        bias=config.bias,
        quantize="nf4" if getattr(model, "is_loaded_in_4bit", False) else None,
    )


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The last part of the name of every linear layer of ``model`` (what ``target_modules`` matches), sorted."""
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if name and _is_linear(m)}
    return sorted(names)


def _is_linear(module: torch.nn.Module) -> bool:
    # bitsandbytes' Linear4bit and GPT-2's Conv1D are linear layers PEFT adapts too.
    return isinstance(module, torch.nn.Linear) or type(module).__name__ in ("Conv1D", "Linear4bit", "Linear8bitLt")


def check_target_modules(model: torch.nn.Module, settings: LoraSettings) -> None:
    """Every name in ``lora.target_modules`` ends some module's name in ``model`` at a dot (``q_proj``, or the whole
    ``model.layers.0.self_attn.q_proj``): PEFT itself adapts the names it finds and drops the rest when one matches."""
    if isinstance(settings.target_modules, str):
        return
    parts = [name.split(".") for name, _ in model.named_modules() if name]
    present = {".".join(part[i:]) for part in parts for i in range(len(part))}  # PEFT matches a name's end
    missing = [name for name in settings.target_modules if name not in present]
    if missing:
        raise ValueError(
            f"lora.target_modules names {missing}, which {type(model).__name__} does not have; its linear layers "
            f"are {linear_module_names(model)} (or use lora.target_modules='all-linear')."
        )


def apply_lora(model: torch.nn.Module, settings: LoraSettings | Mapping[str, Any]) -> torch.nn.Module:
    """``model`` (a Hugging Face causal LM) wrapped with a LoRA adapter: PEFT's ``get_peft_model``. The base is
    frozen, only the adapter's parameters (and the biases ``lora.bias`` names) require grad.

    A QLoRA base (``quantize="nf4"``: loaded 4-bit, :func:`quantized_load_kwargs`) is first made trainable by
    PEFT's ``prepare_model_for_kbit_training``: every parameter left in fp16/bf16 (norms, embeddings, the LM head:
    all but the 4-bit weights) is cast to fp32, and checkpointing, when on, is enabled again. That call passes its
    own (empty) checkpoint arguments, so torch would fall back to reentrant checkpointing; we pass
    ``use_reentrant=False``, the mode the memory estimate models and transformers' default. Under plain LoRA with
    checkpointing the input embeddings' output requires grad, so that the checkpointed layers still reach the
    adapter with a frozen embedding in front of them.

    Raises:
        ImportError: PEFT is not installed.
        ValueError: a target module the model lacks; ``quantize="nf4"`` on a base that was not loaded in 4-bit.
    """
    settings = LoraSettings.from_value(settings)
    peft = import_peft()
    check_target_modules(model, settings)
    checkpointing = _is_checkpointing(model)
    if settings.quantize is not None:
        if not getattr(model, "is_loaded_in_4bit", False):
            raise ValueError(
                "lora.quantize='nf4' needs a base loaded in 4-bit: build it with quantized_load_kwargs(settings) "
                "(CausalLM(pretrained_path=..., lora=dict(quantize='nf4')) does)."
            )
        model = peft.prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=checkpointing, gradient_checkpointing_kwargs=NON_REENTRANT
        )
    elif checkpointing and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    return peft.get_peft_model(model, settings.peft_config())


NON_REENTRANT = {"use_reentrant": False}  # torch.utils.checkpoint's recommended mode (reentrant is its old default)


def _is_checkpointing(model: torch.nn.Module) -> bool:
    # transformers 5 renames is_gradient_checkpointing (deprecated) to is_activation_checkpointing
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


# ------------------------------------------------------------------------------------------------- QLoRA
def check_quantization(settings: LoraSettings | None, device: torch.device | str | None = None) -> None:
    """QLoRA where it can run: bitsandbytes installed and a CUDA device (``device``, else any visible one).

    Raises:
        ImportError: bitsandbytes is not installed.
        ValueError: no CUDA device (bitsandbytes' 4-bit kernels run on CUDA only).
    """
    if settings is None or settings.quantize is None:
        return
    require_bitsandbytes(
        "lora.quantize='nf4' (QLoRA)",
        "bitsandbytes' 4-bit kernels",
        "use lora.quantize=None (plain LoRA, the base in the training precision), or train on a CUDA GPU",
        "QLoRA",
        device,
    )


def quantized_load_kwargs(settings: LoraSettings) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments that load the base in 4-bit NF4 (QLoRA's recipe: double quantization,
    bf16 compute where the GPU has it, else fp16) onto this process's GPU (``LOCAL_RANK``)."""
    check_quantization(settings)
    from transformers import BitsAndBytesConfig

    compute = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=settings.quantize,
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute,
    )
    return {"quantization_config": config, "dtype": compute, "device_map": {"": int(os.environ.get("LOCAL_RANK", 0))}}


# --------------------------------------------------------------------------------------- adapted models
def trainable_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of every parameter that requires grad: with an adapter, the adapter's only."""
    return ((name, p) for name, p in model.named_parameters() if p.requires_grad)


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts of ``model``."""
    trainable = sum(p.numel() for _, p in trainable_parameters(model))
    return trainable, sum(p.numel() for p in model.parameters())


def _require_peft(model: Any, action: str) -> None:
    if not is_peft_model(model):
        raise ValueError(
            f"{action} needs a PEFT model (get_peft_model's, or CausalLM(lora=...).model), not {type(model).__name__}."
        )


def save_adapter(
    model: torch.nn.Module, directory: str | os.PathLike, state_dict: Mapping[str, torch.Tensor] | None = None
) -> str:
    """Write the adapter alone (``adapter_config.json``, ``adapter_model.safetensors``) in PEFT's own format:
    ``PeftModel.from_pretrained(base, directory)`` loads it onto the same base. Returns the directory.

    ``state_dict``: the PEFT model's whole state under its own names, where the module's parameters are not the whole
    tensors (FSDP's shards: its full state dict, gathered); PEFT picks the adapter's entries from it."""
    _require_peft(model, "save_adapter")
    os.makedirs(directory, exist_ok=True)
    if state_dict is None:
        model.save_pretrained(str(directory))
        return str(directory)
    # PEFT picks the adapter's entries by the paths of its layers, which FSDP units inside the model lengthen with
    # their own segment (PEFT removes it only in front): it is given the state under those paths, and the file's
    # names are made the module's own again, as a plain model's save has them.
    paths = {unwrapped_name(name): name for name, _ in [*model.named_parameters(), *model.named_buffers()]}
    model.save_pretrained(str(directory), state_dict={paths.get(key, key): value for key, value in state_dict.items()})
    weights = os.path.join(directory, "adapter_model.safetensors")
    from safetensors.torch import load_file, save_file

    saved = load_file(weights)
    if any(unwrapped_name(key) != key for key in saved):
        save_file({unwrapped_name(key): value for key, value in saved.items()}, weights, metadata={"format": "pt"})
    return str(directory)


# Segments wrappers insert into parameter names but not into state dict keys (FSDP, activation checkpointing,
# torch.compile's OptimizedModule).
_WRAPPER_SEGMENTS = re.compile(r"(^|\.)(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)(?=\.|$)")


def unwrapped_name(name: str) -> str:
    """A parameter's name without the wrappers' segments: its key in a (full) state dict."""
    return _WRAPPER_SEGMENTS.sub("", name).lstrip(".")


def merge_adapter(model: torch.nn.Module) -> torch.nn.Module:
    """The base model with the adapter merged into its weights (PEFT's ``merge_and_unload``): a plain Hugging Face
    model with the adapted model's outputs, for inference or ``save_pretrained``. A 4-bit base is merged after
    dequantization by PEFT, with its rounding."""
    _require_peft(model, "merge_adapter")
    return model.merge_and_unload()
