"""Adapter Export
==============

``SaveAdapter`` writes the LoRA adapter of the trained module in PEFT's own format when ``fit`` ends, so the run
leaves what ``PeftModel.from_pretrained(base, directory)`` loads — a few megabytes, not a copy of the base model.
It finds the PEFT model anywhere in the LightningModule (``CausalLM(lora=...)``'s ``model``, or a user's module
holding one under any attribute).

Under FSDP each rank holds a shard of every parameter, the adapter's included: the whole adapter is gathered first.
Every rank takes part in FSDP's full state dict (the module's state, one FSDP unit at a time; rank 0 alone keeps it,
offloaded to the CPU on a GPU), and rank 0 hands it to PEFT, which writes the adapter's entries: the same files a
single process writes. That state is the whole model on rank 0's host memory for a moment, as a full Lightning
checkpoint is.
"""

from __future__ import annotations

import os
from typing import Any

import torch
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

    A module without a PEFT model gets a warning and nothing is written. Under FSDP the adapter is gathered from
    every rank's shards and written by rank 0 (see the module's docstring).

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
        state = _gathered_state(trainer, found[0])
        if trainer.is_global_zero:
            self.saved_to = save_adapter(found[1], self.directory(trainer), state)
            rank_zero_info(f"[lightning_seqmem] adapter saved to {self.saved_to}")
        trainer.strategy.barrier("SaveAdapter")


def _gathered_state(trainer: Trainer, prefix: str) -> dict[str, Any] | None:
    """Under FSDP, the PEFT model's whole state under its own names on rank 0 (``{}`` on the others; every rank
    must call); ``None`` elsewhere (the module's parameters are whole)."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    wrapper = trainer.strategy.model
    if not isinstance(wrapper, FSDP):
        return None
    # Offloading parameters that are on the CPU already crashes FSDP's gather (torch 2.13): CPU ranks gather in place.
    config = FullStateDictConfig(offload_to_cpu=trainer.strategy.root_device.type != "cpu", rank0_only=True)
    with FSDP.state_dict_type(wrapper, StateDictType.FULL_STATE_DICT, config), torch.no_grad():
        state = wrapper.state_dict()  # FSDP's names removed: the LightningModule's own keys
    start = f"{prefix}." if prefix else ""
    return {key[len(start) :]: value for key, value in state.items() if key.startswith(start)}
