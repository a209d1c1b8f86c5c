"""The LM head's cross-entropy by Liger-Kernel's fused linear cross-entropy (``cross_entropy="liger"``).

An optional extra (Triton kernels, CUDA only) with the arguments and result of the chunked kernel,
``linear_cross_entropy.linear_cross_entropy``, which runs on every device: the backend a CUDA run may choose instead.
Torch only, no Lightning import; Liger-Kernel is imported when called.
"""

from __future__ import annotations

import torch

from lightning_seqmem.batch import IGNORE_INDEX
from lightning_seqmem.messages import check_choice
from lightning_seqmem.training.linear_cross_entropy import REDUCTIONS

__all__ = ["liger_linear_cross_entropy"]


def liger_linear_cross_entropy(
    hidden_states: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    head_bias: torch.Tensor | None = None,
    logit_scale: float | None = None,
    final_logit_softcapping: float | None = None,
) -> torch.Tensor:
    """:func:`linear_cross_entropy` by Liger-Kernel's fused linear cross-entropy (Triton kernels, CUDA only).

    The same arguments and result (no ``chunk_size``: Liger picks its own). A logit scale is folded into the
    hidden states and the bias (``(h W^T + b) s = (s h) W^T + s b``), which Liger has no option for.

    Raises:
        ImportError: ``liger_kernel`` is not installed.
        ValueError: the tensors are not on a CUDA device, or a bad ``reduction``.
    """
    check_choice("reduction", reduction, REDUCTIONS)
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError as error:
        raise ImportError(
            "cross_entropy='liger' needs Liger-Kernel: `pip install liger-kernel` (CUDA and Triton), or use "
            "cross_entropy='chunked', which runs on every device."
        ) from error
    if hidden_states.device.type != "cuda" or head_weight.device.type != "cuda":
        raise ValueError(
            f"cross_entropy='liger' runs on a CUDA device only (Triton kernels), and the hidden states are on "
            f"{hidden_states.device.type}: move the model to a CUDA device, or use cross_entropy='chunked'."
        )
    if logit_scale is not None:
        hidden_states = hidden_states * logit_scale
        head_bias = None if head_bias is None else head_bias * logit_scale
    loss = LigerFusedLinearCrossEntropyLoss(
        ignore_index=ignore_index, reduction=reduction, softcap=final_logit_softcapping
    )
    hidden_size = hidden_states.shape[-1]
    out = loss(head_weight, hidden_states.reshape(-1, hidden_size), labels.reshape(-1), head_bias)
    return out.view(labels.shape) if reduction == "none" else out
