"""What a fresh interpreter sees: the wheel carries conf/ (Hydra composes the main job's config after a plain,
non-editable install); importing the package is torch-free, resolves every export, and silences nothing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _quick_script import quick

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


def test_package_import_is_torch_free():
    """``import lightning_seqmem`` in a fresh interpreter imports no torch (entry points configure the allocator
    before torch starts); the names it exports resolve (here, in this process; in a fresh one: the test below)."""
    script = (
        "import sys, lightning_seqmem as ls\n"
        "assert 'torch' not in sys.modules, 'import lightning_seqmem must not import torch (allocator settings)'\n"
        "print(len(ls.__all__))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    assert int(out) >= 13  # which names: tests/test_structure.py
    import lightning_seqmem as ls

    missing = [n for n in ls.__all__ if getattr(ls, n, None) is None]
    assert not missing, missing


@pytest.mark.slow
def test_a_fresh_interpreter_resolves_every_export_and_leaves_warnings_alone():
    """One fresh interpreter (imports cost ~7 CPU-s, so both checks share it): ``import lightning_seqmem`` is
    torch-free and every export resolves from there, whatever order the lazy imports run in; importing the library
    (and Lightning, and the entry points' modules) leaves warning filters and Lightning's loggers alone; the entry
    point's call adds them, once however often it runs, and drops Lightning's tips."""
    script = (
        "import sys, warnings, logging\n"
        "import lightning_seqmem as ls\n"
        "assert 'torch' not in sys.modules, 'import lightning_seqmem must not import torch (allocator settings)'\n"
        "missing = [n for n in ls.__all__ if getattr(ls, n, None) is None]\n"
        "assert not missing, missing\n"
        "import lightning.pytorch, lightning_seqmem.apps.train, lightning_seqmem.apps.cli\n"
        "from lightning_seqmem.apps import console\n"
        "def ours():\n"
        "    return [f for f in warnings.filters if f[1] is not None and f[1].pattern in console.UPSTREAM_NOISE]\n"
        "logger = logging.getLogger('lightning.pytorch.utilities.rank_zero')\n"
        "assert not ours() and not logger.filters, 'silenced on import'\n"
        "console.quiet_upstream_noise(); console.quiet_upstream_noise()\n"
        "assert len(ours()) == len(console.UPSTREAM_NOISE) and len(logger.filters) == 1\n"
        "record = logging.LogRecord('x', logging.INFO, '', 0, '💡 Tip: try litlogger', None, None)\n"
        "assert not logger.filter(record)\n"
        "print(len(ls.__all__))\n"
    )
    proc = subprocess.run([sys.executable, "-c", quick(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout) >= 13
