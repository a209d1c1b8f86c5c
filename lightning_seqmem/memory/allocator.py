"""Allocator settings: expandable segments for the CUDA caching allocator, set before torch reads them.

PyTorch parses its allocator configuration from the environment when the CUDA caching allocator starts. This module
therefore imports nothing heavy (no torch): entry points call :func:`configure_allocator` first thing. People who
build their own Trainer after torch is imported use :func:`apply_allocator_settings`, which also changes the live
allocator and says clearly when it comes too late for memory that is already reserved.

Facts used (torch release notes and issues):

- ``PYTORCH_ALLOC_CONF`` is the new name from torch 2.8; ``PYTORCH_CUDA_ALLOC_CONF`` stays as an alias. In torch
  2.9.x the new name is silently ignored for ``expandable_segments`` on CUDA (pytorch/pytorch#183387, fixed by
  2.11), so below 2.11 we write the legacy name, which works everywhere (2.8-2.11 print a one-line deprecation).
- Axolotl sets ``expandable_segments:True,roundup_power2_divisions:16`` for torch >= 2.2 and nothing below; so do we.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import MutableMapping

ENV_VAR = "PYTORCH_ALLOC_CONF"
LEGACY_ENV_VAR = "PYTORCH_CUDA_ALLOC_CONF"

__all__ = [
    "ENV_VAR",
    "LEGACY_ENV_VAR",
    "allocator_settings",
    "apply_allocator_settings",
    "configure_allocator",
    "default_settings",
    "env_var_for",
]


def _torch_version() -> tuple[int, int] | None:
    """(major, minor) of the installed torch, read from package metadata so torch is not imported."""
    torch = sys.modules.get("torch")
    version = getattr(torch, "__version__", None)
    if version is None:
        from importlib import metadata

        try:
            version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            return None
    match = re.match(r"(\d+)\.(\d+)", str(version))
    return (int(match.group(1)), int(match.group(2))) if match else None


def env_var_for(version: tuple[int, int] | None) -> str:
    """The environment variable the given torch version reliably reads for CUDA allocator settings.

    Args:
        version: ``(major, minor)`` of torch, or ``None`` when unknown.

    Example::

        env_var_for((2, 13))  # 'PYTORCH_ALLOC_CONF'
        env_var_for((2, 9))   # 'PYTORCH_CUDA_ALLOC_CONF' (the new name is ignored for CUDA in 2.9.x)
    """
    return ENV_VAR if version is not None and version >= (2, 11) else LEGACY_ENV_VAR


def default_settings(
    version: tuple[int, int] | None,
    expandable_segments: bool = True,
    roundup_power2_divisions: int | None = 16,
) -> str | None:
    """The settings string we recommend for a torch version, or ``None`` when it gains nothing from one.

    Args:
        version: ``(major, minor)`` of torch, or ``None`` when unknown (treated as recent).
        expandable_segments: let segments grow instead of caching many fixed-size blocks (less fragmentation when
            sequence length changes from step to step).
        roundup_power2_divisions: round allocation sizes to this many divisions per power of two, so blocks of
            nearby sizes are reused; ``None`` leaves torch's default.

    Example::

        default_settings((2, 13))  # 'expandable_segments:True,roundup_power2_divisions:16'
    """
    if version is not None and version < (2, 2):
        return None  # expandable segments arrived in 2.1 and were unreliable before 2.2 (Axolotl does the same)
    parts = []
    if expandable_segments:
        parts.append("expandable_segments:True")
    if roundup_power2_divisions is not None:
        if not isinstance(roundup_power2_divisions, int) or roundup_power2_divisions < 1:
            raise ValueError(
                f"roundup_power2_divisions must be a positive int or None, got {roundup_power2_divisions!r}."
            )
        parts.append(f"roundup_power2_divisions:{roundup_power2_divisions}")
    return ",".join(parts) or None


def expandable_segments_on(env: MutableMapping[str, str] | None = None) -> bool:
    """Whether the allocator settings in the environment turn expandable segments on."""
    return allocator_settings(env).get("expandable_segments", "").lower() == "true"


def allocator_settings(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The allocator settings in the environment as a dict, e.g. ``{"expandable_segments": "True"}``.

    ``PYTORCH_ALLOC_CONF`` wins over the legacy ``PYTORCH_CUDA_ALLOC_CONF`` as in torch >= 2.8.

    Args:
        env: the environment to read; ``os.environ`` by default.
    """
    env = os.environ if env is None else env
    value = env.get(ENV_VAR) or env.get(LEGACY_ENV_VAR) or ""
    settings = {}
    for item in value.split(","):
        key, _, val = item.partition(":")
        if key.strip():
            settings[key.strip()] = val.strip()
    return settings


def _user_value(env: MutableMapping[str, str]) -> tuple[str, str] | None:
    for name in (ENV_VAR, LEGACY_ENV_VAR):
        if env.get(name):
            return name, env[name]
    return None


def configure_allocator(
    expandable_segments: bool = True,
    roundup_power2_divisions: int | None = 16,
    env: MutableMapping[str, str] | None = None,
) -> str | None:
    """Set the CUDA caching allocator's settings in the environment, unless the user already set them.

    Call it before torch is imported (our entry points do). A value the user set in either
    ``PYTORCH_ALLOC_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF`` is kept as it is, not merged: it is their choice.
    When torch has already started CUDA the environment is no longer read; this warns and points to
    :func:`apply_allocator_settings`.

    Args:
        expandable_segments: see :func:`default_settings`.
        roundup_power2_divisions: see :func:`default_settings`.
        env: the environment to change; ``os.environ`` by default.

    Returns:
        The settings now in effect in the environment (the user's, ours, or ``None`` for none).

    Example::

        from lightning_seqmem.memory.allocator import configure_allocator
        configure_allocator()  # first thing, before `import torch`
    """
    env = os.environ if env is None else env
    user = _user_value(env)
    if user is not None:
        return user[1]
    version = _torch_version()
    value = default_settings(version, expandable_segments, roundup_power2_divisions)
    if value is None:
        return None
    env[env_var_for(version)] = value
    if _cuda_initialized():
        warnings.warn(
            f"configure_allocator() set {env_var_for(version)}={value} after CUDA was initialised, so torch will not "
            "read it. Call it before `import torch`, export the variable in the shell, or call "
            "lightning_seqmem.memory.apply_allocator_settings() to change the running allocator.",
            RuntimeWarning,
            stacklevel=2,
        )
    return value


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    return bool(cuda is not None and cuda.is_initialized())


def _set_live_settings(value: str) -> None:
    """Change the running allocator; the function moved between torch versions."""
    import torch

    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(value)


def apply_allocator_settings(
    expandable_segments: bool = True,
    roundup_power2_divisions: int | None = 16,
    env: MutableMapping[str, str] | None = None,
) -> str | None:
    """Runtime variant of :func:`configure_allocator` for scripts that import torch before building a Trainer.

    Sets the environment like :func:`configure_allocator` and, if torch is imported and CUDA is available, also
    applies the settings to the running allocator. A value the user set is respected in both places. When CUDA is
    already initialised it warns: segments reserved so far keep the old layout, only new ones follow the settings.

    Args:
        expandable_segments: see :func:`default_settings`.
        roundup_power2_divisions: see :func:`default_settings`.
        env: the environment to change; ``os.environ`` by default.

    Returns:
        The settings in effect (the user's, ours, or ``None``).

    Example::

        import torch
        from lightning_seqmem.memory import apply_allocator_settings
        apply_allocator_settings()  # before the first CUDA tensor
    """
    env = os.environ if env is None else env
    user_set = _user_value(env) is not None
    was_initialized = _cuda_initialized()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # we warn below with the runtime-specific text
        value = configure_allocator(expandable_segments, roundup_power2_divisions, env)
    torch = sys.modules.get("torch")
    if value is None or user_set or torch is None or not torch.cuda.is_available():
        return value
    _set_live_settings(value)
    if was_initialized:
        warnings.warn(
            f"CUDA was already initialised when the allocator settings {value!r} were applied: memory reserved "
            "before this call keeps its old layout and only new segments follow the settings. For the full effect "
            f"set {env_var_for(_torch_version())}={value} before starting Python, or call "
            "lightning_seqmem.memory.allocator.configure_allocator() before `import torch`.",
            RuntimeWarning,
            stacklevel=2,
        )
    return value
