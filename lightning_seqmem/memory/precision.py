"""Lightning precisions as the memory estimate sees them: the dtype of the weights, the autocast dtype, and the
closed-form bytes of weights, gradients and AdamW state. Shared by the tracer, the measured step and the estimate."""

from __future__ import annotations

from typing import Any

import torch

PRECISIONS = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
_ALIASES = {
    "32": "32-true",
    32: "32-true",
    "64": "64-true",
    64: "64-true",
    "bf16": "bf16-mixed",
    "16": "16-mixed",
    16: "16-mixed",
}


def normalize_precision(precision: Any) -> str:
    """A Lightning precision (``"bf16-mixed"``, ``"32"``, ``16`` ...) as one of :data:`PRECISIONS`."""
    value = _ALIASES.get(precision, precision)
    if value not in PRECISIONS:
        raise ValueError(
            f"precision={precision!r} cannot be estimated; use one of {list(PRECISIONS)} (fp8/transformer-engine "
            "and quantized precisions are not traced)."
        )
    return value


def parameter_dtype(precision: str) -> torch.dtype:
    """The dtype the weights (and so gradients and AdamW state) are kept in under ``precision``."""
    return {"64-true": torch.float64, "bf16-true": torch.bfloat16, "16-true": torch.float16}.get(
        normalize_precision(precision), torch.float32
    )


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a ``*-mixed`` precision, else ``None``."""
    return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(normalize_precision(precision))


def closed_form_state_bytes(num_parameters: int, num_tensors: int, precision: str = "32-true") -> dict[str, int]:
    """Parameter, gradient and AdamW state bytes: ``p + p + 2p`` bytes per parameter for weights of ``p`` bytes
    (4 + 4 + 8 in fp32 and in the mixed precisions, whose weights stay fp32; 2 + 2 + 4 in bf16/16-true), plus
    AdamW's fp32 step counter, one per parameter tensor."""
    size = torch.empty((), dtype=parameter_dtype(precision)).element_size()
    return {
        "parameters": size * num_parameters,
        "gradients": size * num_parameters,
        "optimizer_state": 2 * size * num_parameters + 4 * num_tensors,
    }
