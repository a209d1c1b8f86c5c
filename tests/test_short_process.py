"""A console script's short process (apps/short_process.py): imports with the cyclic collector paused, and an exit
that runs the exit handlers and flushes the streams but skips the interpreter's teardown — only in a process of its
own, never in a caller's (a test, a notebook)."""

import gc
import subprocess
import sys
import textwrap

import pytest

from lightning_seqmem.apps.short_process import freeze_for_teardown, is_process_entry, leave_now, pause_gc, resume_gc

SCRIPT = textwrap.dedent(
    """
    import atexit, gc, os, sys
    from lightning_seqmem.apps.short_process import freeze_for_teardown, leave_now, pause_gc, resume_gc

    class TornDown:
        def __del__(self, write=os.write):  # runs in the interpreter's teardown, when there is one
            write(1, b" torn down")

    kept = TornDown()

    def main():
        # what the teardown's collector pass will walk, noted as the exit handlers run
        atexit.register(lambda: open(sys.argv[1], "w").write(f"exit handler ran {len(gc.get_objects())}"))
        if sys.argv[3] == "pause":
            pause_gc(main)
            import json  # noqa: F401
            paused = not gc.isenabled()
            resume_gc()
            sys.stdout.write(f"paused={paused} enabled={gc.isenabled()} frozen={gc.get_freeze_count() > 0}")
        sys.stdout.write("done")  # buffered, no newline
        if sys.argv[2] == "leave":
            leave_now(main, 3)
        if sys.argv[2] == "freeze":
            freeze_for_teardown(main)
        return 3

    sys.exit(main())
    """
)


def _run(tmp_path, how, pause="no"):
    marker = tmp_path / f"{how}-{pause}.txt"
    cmd = [sys.executable, "-c", SCRIPT, str(marker), how, pause]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    said, walked = marker.read_text().rsplit(" ", 1)
    assert said == "exit handler ran", out.stderr
    assert out.returncode == 3, out.stderr
    return out.stdout, int(walked)


def test_leave_now_runs_the_exit_handlers_flushes_and_skips_the_teardown(tmp_path):
    assert _run(tmp_path, "leave")[0] == "done"
    assert _run(tmp_path, "return")[0] == "done torn down"  # the same script ending as usual: its teardown runs


def test_freeze_for_teardown_runs_the_exit_handlers_and_leaves_the_collector_nothing_to_walk(tmp_path):
    out, walked = _run(tmp_path, "freeze")
    assert out == "done" and walked < 100  # flushed; the module-level object is frozen, its __del__ not run
    out, walked = _run(tmp_path, "return")
    assert out == "done torn down" and walked > 5000  # the same script ending as usual: every object walked


@pytest.mark.parametrize("how", ["leave", "return"])
def test_pause_gc_then_resume_gc_freezes_and_collects_again(tmp_path, how):
    assert _run(tmp_path, how, "pause")[0].startswith("paused=True enabled=True frozen=True")


def test_called_from_a_test_neither_pauses_the_collector_nor_leaves(monkeypatch):
    def main():
        return None

    # Recorded rather than read off ``gc.get_freeze_count()``: that count also drops whenever a frozen object dies.
    freezes = []
    monkeypatch.setattr(gc, "freeze", lambda: freezes.append(True))
    assert not is_process_entry(main)
    pause_gc(main)
    assert gc.isenabled()
    resume_gc()
    assert gc.isenabled() and not freezes
    freeze_for_teardown(main)
    assert not freezes
    leave_now(main, 5)  # returns: this test process goes on
