"""Allocator settings: set before torch, never over a user's value, with a clear warning when too late."""

import subprocess
import sys
import types

import pytest

from lightning_seqmem.memory import allocator
from lightning_seqmem.memory.allocator import (
    ENV_VAR,
    LEGACY_ENV_VAR,
    allocator_settings,
    apply_allocator_settings,
    configure_allocator,
    default_settings,
    env_var_for,
)

OURS = "expandable_segments:True,roundup_power2_divisions:16"


def test_importing_the_allocator_and_the_package_does_not_import_torch():
    code = (
        "import sys\n"
        "import lightning_seqmem\n"
        "from lightning_seqmem.memory.allocator import configure_allocator\n"
        "from lightning_seqmem.memory import configure_allocator as again\n"
        "assert configure_allocator(env={}) is not None\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("version", "name", "value"),
    [
        ((2, 13), ENV_VAR, OURS),
        ((2, 11), ENV_VAR, OURS),
        ((2, 9), LEGACY_ENV_VAR, OURS),
        ((2, 5), LEGACY_ENV_VAR, OURS),
        ((2, 1), None, None),
    ],
)
def test_sets_the_variable_the_torch_version_reads(monkeypatch, version, name, value):
    monkeypatch.setattr(allocator, "_torch_version", lambda: version)
    env = {}
    assert configure_allocator(env=env) == value
    assert env == ({name: value} if name else {})


@pytest.mark.parametrize("user_var", [ENV_VAR, LEGACY_ENV_VAR])
def test_respects_a_value_the_user_set(user_var):
    env = {user_var: "max_split_size_mb:128"}
    assert configure_allocator(env=env) == "max_split_size_mb:128"
    assert env == {user_var: "max_split_size_mb:128"}  # untouched, nothing added beside it
    assert apply_allocator_settings(env=env) == "max_split_size_mb:128"
    assert env == {user_var: "max_split_size_mb:128"}


def test_default_settings_options():
    assert default_settings((2, 13), roundup_power2_divisions=None) == "expandable_segments:True"
    assert default_settings((2, 13), expandable_segments=False) == "roundup_power2_divisions:16"
    assert default_settings((2, 13), expandable_segments=False, roundup_power2_divisions=None) is None
    assert env_var_for(None) == LEGACY_ENV_VAR
    with pytest.raises(ValueError, match="roundup_power2_divisions"):
        default_settings((2, 13), roundup_power2_divisions=0)


def test_allocator_settings_parses_and_prefers_the_new_name():
    env = {ENV_VAR: "expandable_segments:True, roundup_power2_divisions:16", LEGACY_ENV_VAR: "max_split_size_mb:64"}
    assert allocator_settings(env) == {"expandable_segments": "True", "roundup_power2_divisions": "16"}
    assert allocator_settings({LEGACY_ENV_VAR: "max_split_size_mb:64"}) == {"max_split_size_mb": "64"}
    assert allocator_settings({}) == {}


def test_warns_when_cuda_is_already_initialised(monkeypatch):
    monkeypatch.setattr(allocator, "_cuda_initialized", lambda: True)
    with pytest.warns(RuntimeWarning, match="after CUDA was initialised"):
        configure_allocator(env={})


def _fake_cuda(monkeypatch, initialized: bool) -> list[str]:
    """torch 2.13 with a GPU, CUDA started or not; returns the list the live allocator's settings are applied to."""
    applied = []
    cuda = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: initialized)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(allocator, "_torch_version", lambda: (2, 13))
    monkeypatch.setattr(allocator, "_set_live_settings", applied.append)
    return applied


def test_runtime_variant_applies_to_the_live_allocator_and_warns_when_late(monkeypatch):
    applied = _fake_cuda(monkeypatch, initialized=True)
    env = {}
    with pytest.warns(RuntimeWarning, match="only new segments follow"):
        assert apply_allocator_settings(env=env) == OURS
    assert applied == [OURS] and env == {ENV_VAR: OURS}


def test_runtime_variant_is_quiet_before_cuda_starts(monkeypatch, recwarn):
    applied = _fake_cuda(monkeypatch, initialized=False)
    assert apply_allocator_settings(env={}) == OURS
    assert applied == [OURS]
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
