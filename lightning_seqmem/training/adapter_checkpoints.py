"""What a checkpoint keeps of an adapted model: the adapter, not a second copy of a base that can be loaded again.

A LoRA run on a ``pretrained_path`` base trains the adapter only; the base is frozen and exists on disk already. Its
Lightning checkpoint leaves the base out (:func:`drop_frozen_base`, recording the keys it left out) and a load or a
resume takes it from the model built from ``pretrained_path`` (:func:`restore_frozen_base`); the optimizer state is
the adapter's only either way.

Under FSDP the same holds with two differences. Parameter names carry the wrappers' segments
(``_fsdp_wrapped_module`` of each FSDP unit inside the model) while the full state dict's keys do not: names are
compared with those segments removed. And Lightning's FSDP strategy loads the model's state inside
``load_checkpoint``, before ``on_load_checkpoint`` could put the base back: the PEFT model of a ``pretrained_path``
base admits a state dict that lacks its whole base (:func:`admit_rebuilt_base`, a load hook), and only that one. A
sharded FSDP checkpoint (``state_dict_type="sharded"``: each rank's shard, loaded by name by torch's distributed
checkpoint) keeps everything. Torch only (no Lightning).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_seqmem.messages import short_repr
from lightning_seqmem.training.adapters import find_peft_model, trainable_parameters, unwrapped_name

BASE_RECORD = "lightning_seqmem_frozen_base"  # the checkpoint entry naming the base weights left out
_FLAT_PARAMETER = "_flat_param"  # FSDP's flat parameter of a unit: no checkpoint key, no model weight
_SHARDED_TYPES = ("DTensor", "ShardedTensor")  # a sharded state dict's entries: torch's distributed checkpoint


def frozen_base_keys(module: torch.nn.Module, state_dict: Mapping[str, Any]) -> list[str]:
    """The entries of ``module``'s ``state_dict`` that belong to the frozen base of its PEFT model: every key
    under the PEFT model's prefix but the parameters that train (the adapter). ``[]`` without a PEFT model, for a
    sharded state dict, and when no key of ``state_dict`` is a trainable parameter's name (names that do not match
    are never taken for the base: the adapter must not be dropped with it; FSDP with ``use_orig_params=False`` names
    only its flat parameters)."""
    found = find_peft_model(module)
    if found is None or any(type(value).__name__ in _SHARDED_TYPES for value in state_dict.values()):
        return []
    prefix = f"{unwrapped_name(found[0])}." if found[0] else ""
    trainable = {unwrapped_name(name) for name, _ in trainable_parameters(module)}
    if not trainable & set(state_dict):
        return []
    return [key for key in state_dict if key.startswith(prefix) and key not in trainable]


def drop_frozen_base(module: torch.nn.Module, checkpoint: dict[str, Any]) -> list[str]:
    """Leave the frozen base (:func:`frozen_base_keys`) out of a Lightning ``checkpoint``'s ``state_dict``, for a
    base that can be loaded again (``pretrained_path``): the checkpoint keeps the adapter, the optimizer state (the
    adapter's only) and everything else a resume needs, and records the keys left out. Returns them. (Under FSDP
    only rank 0 holds the full state dict; the other ranks' is empty and stays so.)"""
    state_dict = checkpoint["state_dict"]
    dropped = frozen_base_keys(module, state_dict)
    for key in dropped:
        del state_dict[key]
    if dropped:
        checkpoint[BASE_RECORD] = dropped
    return dropped


def restore_frozen_base(module: torch.nn.Module, checkpoint: dict[str, Any]) -> None:
    """Put the base entries :func:`drop_frozen_base` left out back into ``checkpoint["state_dict"]`` from
    ``module`` as it was built (from the same pretrained weights), so that a strict load restores the adapter and
    keeps the base. A checkpoint that holds its base is left as it is, and so is one whose state the strategy has
    loaded already (FSDP: :func:`admit_rebuilt_base` let that load through).

    Raises:
        ValueError: the module built now has no entry of that name (a different base model or adapter).
    """
    dropped = checkpoint.get(BASE_RECORD)
    if not dropped or "state_dict" not in checkpoint:
        return
    current = {unwrapped_name(key): value for key, value in module.state_dict().items()}
    missing = [key for key in dropped if key not in current]
    if missing:
        raise ValueError(
            f"The checkpoint's frozen base weights were left to be loaded from pretrained_path again, but the model "
            f"built now lacks {short_repr(missing)}: build it from the same base model and LoRA settings."
        )
    for key in dropped:
        checkpoint["state_dict"][key] = current[key]


def admit_rebuilt_base(peft_model: torch.nn.Module) -> None:
    """Let a strict ``load_state_dict`` through ``peft_model`` (built on pretrained weights) accept a state dict
    that lacks exactly its whole frozen base, as :func:`drop_frozen_base` writes it: the base it holds is the one
    the checkpoint left out. Needed where a strategy loads the state before ``on_load_checkpoint`` (Lightning's
    FSDP); a state dict that lacks part of the base, or any of the adapter, still fails as before."""

    def hook(module: torch.nn.Module, incompatible: Any) -> None:
        base = _relative_base_names(module)
        if not base or not incompatible.missing_keys:
            return
        missing = {key: unwrapped_name(key) for key in incompatible.missing_keys}
        of_base = {key for key, name in missing.items() if any(_ends_with(name, b) for b in base)}
        covered = {b for b in base if any(_ends_with(missing[key], b) for key in of_base)}
        adapter = {unwrapped_name(n) for n, _ in trainable_parameters(module)}
        lacks_adapter = any(_ends_with(name, a) for name in missing.values() for a in adapter)
        if covered == base and not lacks_adapter:
            incompatible.missing_keys[:] = [key for key in incompatible.missing_keys if key not in of_base]

    peft_model.register_load_state_dict_post_hook(hook)


def _relative_base_names(module: torch.nn.Module) -> set[str]:
    """The frozen base's state names under ``module``: its parameters that do not train (each name of a tied one)
    and its persistent buffers."""
    names = {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    names |= {n for n, _ in module.named_buffers(remove_duplicate=False) if _is_persistent(module, n)}
    return {unwrapped_name(name) for name in names if not name.endswith(_FLAT_PARAMETER)}


def _is_persistent(module: torch.nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    return leaf not in module.get_submodule(owner)._non_persistent_buffers_set


def _ends_with(name: str, suffix: str) -> bool:
    return name == suffix or name.endswith("." + suffix)
