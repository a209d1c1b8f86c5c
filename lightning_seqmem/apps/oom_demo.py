"""``callbacks=[default,inject_oom]``: a pretend out-of-memory, to see ``model.on_oom=split`` work on a CPU.

A CPU does not run out of memory at a micro-batch's size, so ``seqmem-train model.on_oom=split`` shows nothing
there. ``InjectOom`` installs ``oom.split.OomInjector`` once training starts (after the model is built and any
pre-allocation step has run): every micro-batch over ``max_tokens`` then fails as a GPU's would, and the run's
summary (``oom_splits``) says how many were split and trained.
"""

from __future__ import annotations

import operator
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_seqmem.oom.split import OomInjector

__all__ = ["InjectOom"]


class InjectOom(Callback):
    """Make ``module`` of the LightningModule (an attribute path: ``model`` is the Hugging Face model of
    ``CausalLM``, ``model.model.layers.0`` its first decoder layer) run out of memory above ``max_tokens``.

    Args:
        max_tokens: the most tokens (rows x length) the module takes.
        where: ``"forward"`` (before the module runs) or ``"backward"`` (in the backward through it).
        module: the attribute path of the module, from the LightningModule.
        times: fail at most this many times (``None``: every time).

    Example::

        Trainer(callbacks=[InjectOom(max_tokens=256)]).fit(CausalLM(on_oom="split"), datamodule=dm)
    """

    def __init__(self, max_tokens: int, where: str = "forward", module: str = "model", times: int | None = None):
        self.injector = OomInjector(max_tokens=max_tokens, where=where, times=times)
        self.module = module
        self._handle: Any = None

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._handle is None:
            try:
                target = operator.attrgetter(self.module)(pl_module)
            except AttributeError:
                raise ValueError(
                    f"InjectOom: {type(pl_module).__name__} has no module at {self.module!r}; give "
                    "callbacks.inject_oom.module=<attribute path>, e.g. model or model.model.layers.0."
                ) from None
            self._handle = self.injector.install(target)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
