"""The wheel carries conf/: Hydra composes the main job's config after a plain, non-editable install."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_ships_conf_and_hydra_finds_it(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)],
        check=True,
        cwd=tmp_path,
    )
    [wheel] = list(wheels.glob("lightning_seqmem-*.whl"))
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True,
        cwd=tmp_path,
    )
    script = (
        "import lightning_seqmem, hydra, sys\n"
        "assert lightning_seqmem.__file__.startswith(sys.argv[1]), lightning_seqmem.__file__\n"
        "from hydra import compose, initialize_config_module\n"
        "with initialize_config_module(config_module='lightning_seqmem.conf', version_base='1.3'):\n"
        "    cfg = compose(config_name='config', overrides=['data.max_length=64'])\n"
        "print(cfg.data._target_, cfg.data.max_length, cfg.model._target_)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run(
        [sys.executable, "-c", script, str(site)], cwd=tmp_path, env=env, check=True, capture_output=True, text=True
    ).stdout
    assert "SeqMemDataModule 64 lightning_seqmem.CausalLM" in out


def test_package_import_is_torch_free_and_every_export_resolves():
    script = (
        "import sys, lightning_seqmem as ls\n"
        "assert 'torch' not in sys.modules, 'import lightning_seqmem must not import torch (allocator settings)'\n"
        "missing = [n for n in ls.__all__ if getattr(ls, n, None) is None]\n"
        "assert not missing, missing\n"
        "print(len(ls.__all__))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    assert int(out) >= 13  # which names: tests/test_structure.py
