"""A memory model of bitsandbytes' 4-bit linear layer in pure torch, so that QLoRA can be estimated on any machine.

bitsandbytes' ``Linear4bit`` has no fake-tensor kernels (the tracer cannot run it) and no CPU training path worth
measuring, so the estimate of a QLoRA run (``lora=dict(quantize="nf4")``) traces this stand-in instead. It is a
model of the layer's **memory**, not of its numerics: it stores and allocates what bitsandbytes stores and
allocates, and its weight values are not NF4 levels (each dequantized value is its block's scale).

What it holds (bitsandbytes' ``Params4bit`` as transformers' ``BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)`` loads it, QLoRA's recipe; ``bitsandbytes/
functional.py: quantize_4bit`` and ``quantize_blockwise``):

- the weight packed two 4-bit codes per byte: ``uint8 [(n + 1) // 2, 1]`` for ``n = out * in`` values;
- one scale (absmax) per block of 64 values: ``fp32 [blocks]``, or with double quantization (``nested``) those
  scales quantized again: ``uint8 [blocks]`` plus the second state, ``fp32`` absmax per 256 blocks, its 256-entry
  ``fp32`` code (copied per layer) and an ``fp32`` offset (their mean);
- the 16-entry ``fp32`` NF4 code.

Its forward is bitsandbytes' ``Linear4bit.forward`` and ``MatMul4Bit``: the input cast to the compute dtype, the
scales dequantized to ``fp32 [blocks]`` (plus the offset: a second one, the first freed), the whole weight
dequantized to ``[out, in]`` in the compute dtype, multiplied, freed, the output cast back to the input's dtype.
Its backward saves nothing but the packed weight (a parameter already) and dequantizes again to multiply the output
gradient; no weight gradient. The LM head and the embeddings stay unquantized (transformers skips ``lm_head``);
:func:`quantize_linears` swaps every other ``nn.Linear`` of a causal LM, and PEFT's LoRA goes on top.
``tests/test_qlora_shape.py`` checks the stored bytes against bitsandbytes' formula and the traced estimate against
the CPU profiler's peak of this stand-in training for real.
"""

from __future__ import annotations

import torch

BLOCKSIZE = 64  # bitsandbytes' default 4-bit block (Params4bit, quantize_4bit)
NESTED_BLOCKSIZE = 256  # the double quantization's block of scales (quantize_blockwise(absmax, blocksize=256))
CODE_ENTRIES = 256  # the 8-bit dynamic code of the second state
NF4_ENTRIES = 16
COMPUTE_DTYPE = torch.bfloat16  # quantized_load_kwargs' bnb_4bit_compute_dtype where the GPU has bf16


def _blocks(count: int, size: int) -> int:
    return -(-count // size)


def stored_bytes(out_features: int, in_features: int, double_quant: bool = True, blocksize: int = BLOCKSIZE) -> int:
    """Bytes bitsandbytes keeps for a 4-bit ``[out, in]`` weight: packed codes, scales, second state, NF4 code."""
    n = out_features * in_features
    blocks = _blocks(n, blocksize)
    packed, code = (n + 1) // 2, NF4_ENTRIES * 4
    if not double_quant:
        return packed + 4 * blocks + code
    return packed + blocks + 4 * _blocks(blocks, NESTED_BLOCKSIZE) + 4 * CODE_ENTRIES + 4 + code


def _frozen(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor, requires_grad=False)


class Linear4bitShape(torch.nn.Linear):
    """bitsandbytes' ``Linear4bit`` (NF4, block 64, double quantization by default) as memory: see the module
    docstring. An ``nn.Linear`` to PEFT (``in_features``/``out_features``, LoRA's default wrapper), whose weight is
    the packed ``uint8`` codes; the quantization state is frozen parameters (``weight_absmax`` ...), so the tracer
    counts it with the weights.

    Args:
        linear: the layer it replaces (its shape, bias and device; its values are not kept).
        compute_dtype: the dtype the weight is dequantized to and multiplied in.
        double_quant: quantize the scales again (``bnb_4bit_use_double_quant``).
    """

    def __init__(
        self, linear: torch.nn.Linear, compute_dtype: torch.dtype = COMPUTE_DTYPE, double_quant: bool = True
    ) -> None:
        torch.nn.Module.__init__(self)  # nn.Linear's own __init__ would allocate a full-precision weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype, self.double_quant, self.blocksize = compute_dtype, double_quant, BLOCKSIZE
        device, n = linear.weight.device, linear.in_features * linear.out_features
        blocks = _blocks(n, BLOCKSIZE)
        self.weight = _frozen(torch.zeros(((n + 1) // 2, 1), dtype=torch.uint8, device=device))
        if double_quant:
            self.weight_absmax = _frozen(torch.ones(blocks, dtype=torch.uint8, device=device))
            self.weight_absmax2 = _frozen(torch.full((_blocks(blocks, NESTED_BLOCKSIZE),), 0.02, device=device))
            self.weight_code2 = _frozen(torch.linspace(-1, 1, CODE_ENTRIES, device=device))
            self.weight_offset = _frozen(torch.zeros((), device=device))
        else:
            self.weight_absmax = _frozen(torch.full((blocks,), 0.02, device=device))
        self.weight_code = _frozen(torch.linspace(-1, 1, NF4_ENTRIES, device=device))
        self.bias = linear.bias  # kept unquantized, as Linear4bit keeps it

    def scales(self) -> torch.Tensor:
        """``fp32 [blocks]``: the per-block scales, as ``dequantize_blockwise`` of the nested state plus the offset
        (two tensors of that size, the first freed) or the stored ones."""
        if not self.double_quant:
            return self.weight_absmax
        scales = self.weight_absmax.to(torch.float32)  # dequantize_blockwise's fp32 output
        return scales + self.weight_offset

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """``[out, in]`` in ``dtype``: each value its block's scale (memory as ``dequantize_4bit``, not its values)."""
        scales = self.scales()
        weight = torch.empty(self.out_features * self.in_features, dtype=dtype, device=scales.device)
        full = weight.numel() // self.blocksize * self.blocksize
        weight[:full].view(-1, self.blocksize).copy_(scales[: full // self.blocksize, None])
        if full < weight.numel():
            weight[full:].copy_(scales[-1].expand(weight.numel() - full))
        return weight.view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``Linear4bit.forward``: ``[..., in]`` cast to the compute dtype, the 4-bit product, cast back."""
        dtype = x.dtype
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        out = _MatMul4bitShape.apply(x.to(self.compute_dtype), self.weight, self, bias)
        return out.to(dtype)


class _MatMul4bitShape(torch.autograd.Function):
    """bitsandbytes' ``MatMul4Bit``: no weight gradient, nothing saved but the packed weight."""

    @staticmethod
    def forward(ctx, x, packed, layer, bias):
        ctx.layer, ctx.has_bias = layer, bias is not None
        return torch.nn.functional.linear(x, layer.dequantize(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        grad_bias = grad.sum(tuple(range(grad.dim() - 1))) if ctx.has_bias and ctx.needs_input_grad[3] else None
        grad_x = torch.matmul(grad, ctx.layer.dequantize(grad.dtype)) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, grad_bias


def quantize_linears(model: torch.nn.Module, compute_dtype: torch.dtype = COMPUTE_DTYPE) -> torch.nn.Module:
    """``model`` (a causal LM) with every ``nn.Linear`` but its output head replaced by :class:`Linear4bitShape`,
    as transformers' 4-bit load quantizes it (``lm_head`` skipped; embeddings are not linear layers). In place;
    returns ``model``. Made in the current mode: under a ``FakeTensorMode`` the stand-ins are fake too."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear and module is not head and name
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Linear4bitShape(module, compute_dtype))
    return model


def quantized_state_bytes(model: torch.nn.Module) -> int:
    """Bytes of every :class:`Linear4bitShape`'s packed weight and quantization state in ``model``."""
    return sum(
        p.numel() * p.element_size()
        for m in model.modules()
        if isinstance(m, Linear4bitShape)
        for name, p in m.named_parameters(recurse=False)
        if name.startswith("weight")
    )
