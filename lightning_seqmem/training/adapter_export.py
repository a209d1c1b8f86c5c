"""Adapter Export
==============

``SaveAdapter`` writes the LoRA adapter of the trained module in PEFT's own format when ``fit`` ends, so the run
leaves what ``PeftModel.from_pretrained(base, directory)`` loads — a few megabytes, not a copy of the base model.
It finds the PEFT model anywhere in the LightningModule (``CausalLM(lora=...)``'s ``model``, or a user's module
holding one under any attribute).
"""

from __future__ import annotations

import os

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_seqmem.training.adapters import find_peft_model, save_adapter

__all__ = ["SaveAdapter"]

DEFAULT_FOLDER = "adapter"


class SaveAdapter(Callback):
    """Save the module's PEFT adapter at the end of ``fit`` (rank zero; every rank holds the same adapter under
    DDP).

    Args:
        dirpath: the folder to write (``adapter_config.json``, ``adapter_model.safetensors``); ``None``: an
            ``adapter`` folder in the Trainer's log directory (else its ``default_root_dir``).

    A module without a PEFT model gets a warning and nothing is written. Under FSDP each rank holds a shard of the
    adapter, which this callback does not gather: it warns and writes nothing (save a full checkpoint instead).

    Example::

        Trainer(max_steps=100, callbacks=[SaveAdapter("runs/adapter")]).fit(CausalLM(lora=dict(r=16)), datamodule=dm)
        # later: PeftModel.from_pretrained(base_model, "runs/adapter")
    """

    def __init__(self, dirpath: str | os.PathLike | None = None) -> None:
        super().__init__()
        self.dirpath = None if dirpath is None else os.fspath(dirpath)
        self.saved_to: str | None = None

    def directory(self, trainer: Trainer) -> str:
        """Where the adapter goes: ``dirpath``, else ``<log_dir or default_root_dir>/adapter``."""
        if self.dirpath is not None:
            return self.dirpath
        return os.path.join(trainer.log_dir or trainer.default_root_dir, DEFAULT_FOLDER)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        found = find_peft_model(pl_module)
        if found is None:
            rank_zero_warn(
                f"SaveAdapter: {type(pl_module).__name__} holds no PEFT model (no adapter to save); use "
                "CausalLM(lora=dict(r=...)) or wrap your model with peft.get_peft_model."
            )
            return
        from lightning.pytorch.strategies import FSDPStrategy

        if isinstance(trainer.strategy, FSDPStrategy):
            rank_zero_warn("SaveAdapter does not gather an adapter sharded by FSDP: nothing written.")
            return
        if trainer.is_global_zero:
            self.saved_to = save_adapter(found[1], self.directory(trainer))
            rank_zero_info(f"[lightning_seqmem] adapter saved to {self.saved_to}")
        trainer.strategy.barrier("SaveAdapter")
