"""``_forked_app.run_forked_main``, the apps' forked runs: a child runs ``main()`` with its own output, whatever log
handlers earlier tests left in the test process, and a child that cannot start says why."""

import logging

from _forked_app import run_forked_main


def _says_hello():
    logging.getLogger("lightning_seqmem.test_forked_app").warning("hello from the log")
    print("hello")


def test_a_log_handler_left_on_a_closed_stream_does_not_stop_the_child(tmp_path):
    """An in-process run (LightningCLI's) leaves a StreamHandler on a stream that pytest's capture has closed by the
    time a later test forks an app: the child used to end with status 1 and no word before ``main()`` ran."""
    logger = logging.getLogger("lightning_seqmem.test_forked_app")
    stream = open(tmp_path / "captured", "w")  # a capture's file, as pytest's are
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    stream.close()
    try:
        proc = run_forked_main(_says_hello, ["hello"], tmp_path, timeout=60)
    finally:
        logger.removeHandler(handler)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "hello" and "hello from the log" in proc.stderr


def test_a_child_that_cannot_start_says_why(tmp_path):
    proc = run_forked_main(_says_hello, ["hello"], tmp_path / "missing", timeout=60)  # chdir fails before main()
    assert proc.returncode == 1 and "FileNotFoundError" in proc.stderr and "hello" not in proc.stdout
