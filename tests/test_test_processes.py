"""The processes the suite starts run as ``conftest.py`` sets them up: what is set there reaches them."""

import platform
import subprocess
import sys
from pathlib import Path

import pytest
from _quick_script import quick

_REUSE = """
import resource
import numpy as np
a = np.arange(16 << 20)  # 128 MB, written, then freed
del a
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
b = np.arange(16 << 20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the allocator's settings are glibc's")
def test_a_process_the_suite_starts_reuses_the_memory_it_freed():
    """A second array of the size just freed takes the same pages, without a page fault. Without the settings the
    allocator maps fresh memory for it (65-576 faults here, each a page the kernel zeroes), which is what made big
    allocations slow in the test processes."""
    out = subprocess.run([sys.executable, "-c", quick(_REUSE)], capture_output=True, text=True, check=True)
    assert int(out.stdout) < 10, out.stdout


@pytest.mark.skipif(not sys.dont_write_bytecode, reason="Python writes each module's bytecode at its first import")
def test_the_interpreters_the_suite_starts_read_the_package_compiled_once():
    """Told not to write bytecode, an interpreter compiles every module it imports from source; the session wrote
    it once (``conftest._write_bytecode_once``), so each module's compiled file is there and up to date."""
    import importlib.util

    import lightning_seqmem

    package = Path(lightning_seqmem.__file__).parent
    stale = []
    for source in sorted(package.rglob("*.py")):
        cached = Path(importlib.util.cache_from_source(str(source)))
        if not cached.exists() or cached.stat().st_mtime < source.stat().st_mtime:
            stale.append(str(source.relative_to(package)))
    assert not stale, stale
