"""bitsandbytes' ``AdamW8bit`` as memory, so that the estimate counts its state on any machine.

``CausalLM(optimizer="adamw_8bit")`` trains with ``bitsandbytes.optim.AdamW8bit`` (CUDA only). What it keeps per
trained parameter ``p`` of ``n`` values (``bitsandbytes/optim/optimizer.py: Optimizer2State.init_state``, made at
its first step):

- ``n >= min_8bit_size`` (4,096): both moments as ``uint8`` tensors shaped like ``p`` and one ``fp32`` scale
  (absmax) per block of 256 values for each (``absmax1``, ``absmax2``): ``2 n + 8 ceil(n / 256)`` bytes;
- smaller tensors (norm weights, biases, small adapters): both moments in ``fp32``, ``8 n`` bytes;
- once per device: the two 256-entry ``fp32`` quantization maps (signed and unsigned dynamic), shared by every
  parameter.

Its update is one fused kernel per parameter that writes the moments and the parameter in place: no temporaries,
unlike torch's ``foreach`` AdamW. :class:`AdamW8bitShape` is that memory in pure torch (traceable on fake tensors);
its update is not Adam's arithmetic. :func:`traced_optimizer` picks the optimizer the tracer and the measured step
run.
"""

from __future__ import annotations

import torch

from lightning_seqmem.memory.trace import adamw

BLOCK = 256  # values per fp32 scale of an 8-bit moment (bitsandbytes' blockwise optimizers)
MIN_8BIT_SIZE = 4096  # AdamW8bit's min_8bit_size: smaller tensors keep fp32 moments
QMAP_ENTRIES = 256


def state_bytes(numel: int, min_8bit_size: int = MIN_8BIT_SIZE) -> int:
    """Bytes ``AdamW8bit`` keeps for a parameter of ``numel`` values (the shared maps not counted)."""
    if numel < min_8bit_size:
        return 8 * numel
    return 2 * numel + 2 * 4 * -(-numel // BLOCK)


def new_state(p: torch.Tensor, qmaps: tuple[torch.Tensor, torch.Tensor], min_8bit_size: int = MIN_8BIT_SIZE) -> dict:
    """The state ``AdamW8bit.init_state`` makes for ``p`` (``qmaps``: the optimizer's shared signed and unsigned
    maps, referenced by 8-bit state)."""
    if p.numel() < min_8bit_size:
        return {
            "step": 0,
            "state1": torch.zeros_like(p, dtype=torch.float32),
            "state2": torch.zeros_like(p, dtype=torch.float32),
        }
    blocks = -(-p.numel() // BLOCK)
    return {
        "step": 0,
        "state1": torch.zeros_like(p, dtype=torch.uint8),
        "qmap1": qmaps[0],
        "state2": torch.zeros_like(p, dtype=torch.uint8),
        "qmap2": qmaps[1],
        "absmax1": torch.zeros(blocks, dtype=torch.float32, device=p.device),
        "absmax2": torch.zeros(blocks, dtype=torch.float32, device=p.device),
    }


class AdamW8bitShape(torch.optim.Optimizer):
    """``bitsandbytes.optim.AdamW8bit``'s memory (see the module docstring): its state made at the first step as
    bitsandbytes makes it, the parameter updated in place with nothing else allocated. Not its arithmetic."""

    def __init__(self, params, lr: float = 1e-3, min_8bit_size: int = MIN_8BIT_SIZE) -> None:
        super().__init__(params, {"lr": lr})
        self.min_8bit_size = min_8bit_size
        self._qmaps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def qmaps(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The signed and unsigned dynamic maps, one pair per device (``name2qmap``)."""
        if device not in self._qmaps:
            signed = torch.linspace(-1, 1, QMAP_ENTRIES, device=device)
            self._qmaps[device] = (signed, torch.linspace(0, 1, QMAP_ENTRIES, device=device))
        return self._qmaps[device]

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # the maps made (on p's device) for 8-bit state only, as bitsandbytes does
                    qmaps = self.qmaps(p.device) if p.numel() >= self.min_8bit_size else (None, None)
                    state.update(new_state(p, qmaps, self.min_8bit_size))
                state["step"] += 1
                p.add_(p.grad, alpha=-group["lr"])  # in place, as the fused kernel: no temporaries
        return None


OPTIMIZERS = ("adamw", "adamw_8bit")


def traced_optimizer(model: torch.nn.Module, device: str, optimizer: str = "adamw") -> torch.optim.Optimizer:
    """The optimizer the estimate traces over ``model``'s trainable parameters: torch's AdamW (``foreach`` as torch
    picks it on ``device``, :func:`~lightning_seqmem.memory.trace.adamw`) or :class:`AdamW8bitShape`."""
    if optimizer == "adamw":
        return adamw(model, device)
    if optimizer == "adamw_8bit":
        return AdamW8bitShape([p for p in model.parameters() if p.requires_grad])
    raise ValueError(f"optimizer={optimizer!r} cannot be estimated; use one of {OPTIMIZERS}.")
