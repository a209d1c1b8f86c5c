"""A LoRA adapter on a model of fake tensors, so the memory estimate traces what ``CausalLM(lora=...)`` trains.

PEFT cannot wrap a fake model inside its ``FakeTensorMode``: it moves each new adapter to its base layer's device and
dtype with ``Module.to``, which for fake parameters always goes through ``torch.utils.swap_tensors``, and the swap
is refused because the mode's tensor memo holds a weak reference to every parameter made under it (``RuntimeError:
_apply(): Couldn't swap Linear.weight``). So the adapter is added outside the mode with PEFT's
``low_cpu_mem_usage=True`` (its weights made on the meta device, which PEFT does not move), and each meta weight is
then replaced, inside the mode, by a fake parameter of the training dtype: the same modules, names, shapes and
``requires_grad`` as the real adapter, no byte allocated.

QLoRA (``quantize="nf4"``) is traced on :mod:`~lightning_seqmem.memory.qlora_shape`'s stand-in of bitsandbytes'
4-bit layer (its memory, not its numerics: bitsandbytes has no fake-tensor kernels): the base's linear layers but the
head swapped for it inside the mode, then the adapter on top as above.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_seqmem.memory.precision import parameter_dtype
from lightning_seqmem.memory.qlora_shape import quantize_linears
from lightning_seqmem.training.adapters import LoraSettings, check_target_modules, import_peft


def add_fake_lora(mode: Any, model: torch.nn.Module, lora: LoraSettings | Any, precision: str) -> torch.nn.Module:
    """``model`` (built in the fake ``mode``) wrapped with a LoRA adapter of ``lora``'s settings, its adapter
    weights fake parameters in ``precision``'s parameter dtype (Lightning casts the whole module for ``*-true``; the
    adapter is fp32 otherwise, as PEFT makes it). With ``quantize="nf4"`` the base's linear layers (not the head)
    are first swapped for :class:`~lightning_seqmem.memory.qlora_shape.Linear4bitShape` (QLoRA's 4-bit base).

    Raises:
        ValueError: a target module the model lacks.
    """
    settings = LoraSettings.from_value(lora)
    check_target_modules(model, settings)
    if settings.quantize is not None:
        with mode:
            quantize_linears(model)
    peft = import_peft()
    wrapped = peft.get_peft_model(model, settings.peft_config(), low_cpu_mem_usage=True, autocast_adapter_dtype=False)
    dtype = parameter_dtype(precision)
    device = next(p.device for p in wrapped.parameters() if p.device.type != "meta")  # what the fake base stands for
    with mode:
        for module in wrapped.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and param.device.type == "meta":
                    fake = torch.empty(param.shape, dtype=dtype, device=device)
                    module._parameters[name] = torch.nn.Parameter(fake, requires_grad=param.requires_grad)
    wrapped.train()
    return wrapped
