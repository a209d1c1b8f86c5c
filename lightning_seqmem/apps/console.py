"""What our command-line entry points print: each log line once, and no upstream noise that is not the user's.

Called by ``seqmem-train`` and ``seqmem-cli`` (and any other console script of the package) at start-up, never
on ``import lightning_seqmem``: a user's own script keeps every warning and handler it would have without us.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

__all__ = ["UPSTREAM_NOISE", "log_each_line_once", "no_bars_unless_a_terminal", "quiet_upstream_noise"]

# Deprecation notices raised inside torchdata and Lightning (regex on the message), fixed upstream, not by users.
UPSTREAM_NOISE = (
    r".*'set_vital' is deprecated",  # torchdata's StatefulDataLoader on torch >= 2.9
    r".*isinstance\(treespec, LeafSpec\)` is deprecated",  # Lightning's _pytree on torch >= 2.10
)
_TIP_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _NoTips(logging.Filter):
    """Drops Lightning's "💡 Tip: try installing litlogger/litmodels" advertisements."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


_NO_TIPS = _NoTips()


def quiet_upstream_noise() -> None:
    """Silence upstream deprecation warnings, Lightning's product tips and matplotlib's cache notice for this
    process (entry points only)."""
    for pattern in UPSTREAM_NOISE:
        warnings.filterwarnings("ignore", message=pattern)
    for name in _TIP_LOGGERS:
        logger = logging.getLogger(name)
        if _NO_TIPS not in logger.filters:
            logger.addFilter(_NO_TIPS)
    # Hydra's job logging puts the root logger at INFO: matplotlib's "generated new fontManager" on a fresh cache.
    logging.getLogger("matplotlib").setLevel(logging.WARNING)


def log_each_line_once() -> None:
    """Under Hydra's job logging, let Lightning's records reach the console once.

    ``import lightning`` puts its own console handler on the ``lightning`` logger (and on ``lightning.pytorch``
    and ``lightning.fabric`` when the root logger had none yet); Hydra's root handler prints every record again,
    and writes it to the job's log file. With a root handler in place, Lightning's console handlers go and its
    records propagate to the root: one line on the console, the same line in the log file. Imports Lightning.
    """
    import lightning.pytorch  # noqa: F401  (its handlers must exist before they can be removed)

    if not logging.getLogger().handlers:
        return  # no root handler: Lightning's own handler is the only one
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:  # a console handler, not a file handler
                logger.removeHandler(handler)
        logger.propagate = True


def no_bars_unless_a_terminal() -> bool:
    """When standard output is not a terminal (SLURM, ``nohup``, CI, ``| tee``), switch off every tqdm bar of this
    process — datasets' tokenizing and saving, transformers' and the hub's downloads — whose carriage returns and
    cursor codes would fill the log; progress then arrives as log lines (``StepProgressBar``'s own, the token
    cache's line per split). Returns whether bars stay on."""
    if sys.stdout.isatty():
        return True
    os.environ.setdefault("TQDM_DISABLE", "1")  # tqdm >= 4.66 reads its defaults from TQDM_*: every bar off
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:
        pass
    return False
