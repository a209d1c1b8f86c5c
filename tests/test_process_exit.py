"""A process group left open is destroyed at exit, before interpreter finalization (gloo's SIGABRT at teardown)."""

import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

from lightning_seqmem._process_exit import destroy_open_process_group

# Registered before lightning_seqmem is imported, so it runs after the package's hook (atexit is last in, first out).
CHILD = textwrap.dedent("""
    import atexit, os, tempfile
    import torch.distributed as dist
    atexit.register(lambda: print("open at exit:", dist.is_initialized(), flush=True))
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    import lightning_seqmem  # noqa: F401  (what a spawned rank does when it unpickles the package's objects)
    print("open after fit:", dist.is_initialized(), flush=True)
""")


@pytest.mark.slow
def test_a_rank_that_imported_the_package_exits_with_its_process_group_closed():
    """A fresh interpreter, by nature: what runs at its exit is the point (a forked child inherits the package
    already imported and leaves by ``os._exit``). Its cost is importing torch for a real Gloo group."""
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "open after fit: True" in out.stdout and "open at exit: False" in out.stdout


def test_destroy_is_a_no_op_without_a_group():
    assert not dist.is_initialized()
    assert destroy_open_process_group() is False
