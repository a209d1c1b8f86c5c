"""A ``seqmem-train`` job stopped by a signal: stop at once, record "interrupted", say how to go on.

SIGTERM (``scancel``, a pre-emption, ``kill``) and SIGINT (Ctrl-C) are noted as they arrive, so that the job's
status says "interrupted" rather than the ``SystemExit: 1`` Lightning turns a Ctrl-C into, and the last lines name
the newest checkpoint and the command that resumes from it.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
from typing import Any

from lightning_seqmem.apps.checkpoints import CHECKPOINT_DIR, describe, newest_checkpoint

__all__ = ["resume_command", "stop_lines", "stop_on_signals", "stopped_by"]

_received: list[int] = []


def stop_on_signals() -> None:
    """Make SIGTERM stop the job at once: Lightning's own handler only notes the signal and stops at the end of an
    epoch, which for a run bounded by ``max_steps`` is its end, and a multirun then went on to its next job.
    Lightning calls this handler after its own (which passes the signal on to DDP ranks it launched);
    ``SIGTERMException`` is a ``SystemExit`` that no sweep catches, with status 128 + 15 as a shell reports a
    process ended by SIGTERM. SIGINT raises ``KeyboardInterrupt`` as Python's own handler does; both are noted."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    def stop(signum: int, frame: Any) -> None:
        _received.append(signum)
        raise SIGTERMException(128 + signum)

    def interrupt(signum: int, frame: Any) -> None:
        _received.append(signum)
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():  # signals are set from the main thread only
        signal.signal(signal.SIGTERM, stop)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, interrupt)


def stopped_by(error: BaseException | None = None) -> str | None:
    """The signal that stopped the job (``"SIGTERM"``, ``"SIGINT"``), or ``None`` when none did."""
    if _received:
        return signal.Signals(_received[0]).name
    if isinstance(error, KeyboardInterrupt):
        return "SIGINT"
    return None


def resume_command(overrides: list[str], checkpoint: str, argv0: str = "seqmem-train") -> str:
    """The command line that resumes: the job's overrides with ``ckpt_path`` set to ``checkpoint``."""
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != "ckpt_path"]
    return shlex.join([argv0, *kept, f"ckpt_path={checkpoint}"])


def stop_lines(run_dir: str, overrides: list[str], why: str) -> list[str]:
    """What a stopped job prints last: the newest checkpoint (step) and the command to resume, or that there is
    none to resume from."""
    found = newest_checkpoint(os.path.join(run_dir, CHECKPOINT_DIR))
    if found is None:
        hint = (
            ""
            if any(o.startswith("checkpoint_every_n_steps=") for o in overrides)
            else (" (checkpoint_every_n_steps=N keeps one)")
        )
        return [f"stopped by {why}: no checkpoint to resume from{hint}."]
    try:
        step = f" (step {describe(found)['step']})"
    except Exception:  # a checkpoint that cannot be read is named all the same
        step = ""
    return [f"stopped by {why}: last checkpoint {found}{step}", f"resume: {resume_command(overrides, found)}"]


def print_stop(run_dir: str, overrides: list[str], why: str, log: Any) -> None:
    """Log the stop lines (console and train.log), flushed: the process ends right after."""
    for line in stop_lines(run_dir, overrides, why):
        log.info(line)
    sys.stderr.flush()
    sys.stdout.flush()
