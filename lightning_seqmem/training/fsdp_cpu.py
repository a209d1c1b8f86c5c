"""FSDP's full state dict on CPU ranks: gathered in place, not "offloaded" to the CPU it already is on.

Lightning's ``FSDPStrategy`` saves and loads a full state dict (its default ``state_dict_type="full"``) under FSDP's
``FULL_STATE_DICT`` with ``offload_to_cpu=True``. On CPU ranks (gloo) under torch 2.13 FSDP's post-state-dict hook
then kills the process with a segmentation fault while it copies parameters that already are on the CPU: the first
checkpoint ends the run, with no Python error to read. Offloading to where the tensors are buys nothing, so on a CPU
root device :func:`gather_full_state_dict_in_place` makes one strategy's state-dict calls gather with
``offload_to_cpu=False`` (rank 0 alone still keeps the whole state, as Lightning's does). On GPUs nothing changes.
``CausalLM`` calls it at ``setup``; a LightningModule of your own calls it in its ``setup``::

    gather_full_state_dict_in_place(self.trainer.strategy)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

# The strategy calls that gather or scatter a full state dict (loading goes through Lightning's
# ``_load_raw_module_state`` inside ``load_checkpoint``).
_GATHERING = ("lightning_module_state_dict", "optimizer_state", "load_checkpoint")
_MARK = "_seqmem_full_state_dict_in_place"


def full_state_dict_in_place(module: Any, world_size: int, rank0_only: bool = True):
    """Lightning's full-state-dict context (same signature) without ``offload_to_cpu``."""
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, StateDictType
    from torch.distributed.fsdp.api import FullOptimStateDictConfig

    return FullyShardedDataParallel.state_dict_type(
        module=module,
        state_dict_type=StateDictType.FULL_STATE_DICT,
        state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
    )


@contextlib.contextmanager
def _in_place() -> Iterator[None]:
    """For the duration of one strategy call: Lightning's two module-level context factories (the PyTorch and the
    Fabric strategy's) are :func:`full_state_dict_in_place`."""
    import lightning.fabric.strategies.fsdp as fabric_fsdp
    import lightning.pytorch.strategies.fsdp as pytorch_fsdp

    saved = pytorch_fsdp._get_full_state_dict_context, fabric_fsdp._get_full_state_dict_context
    pytorch_fsdp._get_full_state_dict_context = fabric_fsdp._get_full_state_dict_context = full_state_dict_in_place
    try:
        yield
    finally:
        pytorch_fsdp._get_full_state_dict_context, fabric_fsdp._get_full_state_dict_context = saved


def _gathering_in_place(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _in_place():
            return method(*args, **kwargs)

    return call


def gather_full_state_dict_in_place(strategy: Any) -> bool:
    """On a Lightning ``FSDPStrategy`` whose root device is the CPU, make this strategy object's full-state-dict
    save and load gather in place (see the module docstring); anything else is left alone. Idempotent.

    Returns:
        Whether the strategy is one that needed it.
    """
    from lightning.pytorch.strategies import FSDPStrategy

    if not isinstance(strategy, FSDPStrategy) or strategy.root_device.type != "cpu":
        return False
    if not getattr(strategy, _MARK, False):
        for name in _GATHERING:
            setattr(strategy, name, _gathering_in_place(getattr(strategy, name)))
        setattr(strategy, _MARK, True)
    return True
