"""FSDP on CPU ranks, standing in for GPUs: used by ``_memory_fsdp_script.py`` and by ``benchmarks/gpu.py --smoke``.

Lightning passes ``device_id=None`` for a CPU root device, which FSDP refuses without an accelerator, so the wrapper
is built with ``device_id=cpu``. Everything else (the wrapped module, FSDPPrecision, the optimizer over sharded
parameters) is Lightning's own. A test device, not a feature: it stays out of the installed package.
"""

import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import FullyShardedDataParallel


class CPUFSDPStrategy(FSDPStrategy):
    """``FSDPStrategy`` whose wrapper is built with ``device_id=cpu`` (use ``process_group_backend="gloo"``)."""

    def _setup_model(self, model):
        return FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )
