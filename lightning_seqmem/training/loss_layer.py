"""The loss layer of a causal LM: its head and cross-entropy over whole logits, or chunk by chunk, or Liger's.

``CausalLM(cross_entropy=...)``, ``DPO(cross_entropy=...)`` and the memory tracer choose here how a Hugging Face
causal LM turns its last hidden states into a loss:

- ``"full"``: the model's own forward with ``labels`` (``[rows, length, vocab]`` logits, upcast to fp32 by the
  transformers loss): today's path, exact by definition.
- ``"chunked"``: the base model alone (``model.base_model``: hidden states out, no logits), then
  :func:`~lightning_seqmem.training.linear_cross_entropy.linear_cross_entropy` over the trained positions only,
  chunk by chunk, with the head's weight (tied embeddings included: it is the same tensor).
- ``"liger"``: the same split with Liger-Kernel's fused kernel (an optional extra; CUDA only).
- ``"auto"``: :func:`resolve_cross_entropy`, ``"chunked"`` once the logits of the largest micro-batch are large
  enough to matter, ``"full"`` below.

A head that does more than a matmul gets it applied per chunk when it is one the kernel knows (a bias, Cohere's
``logit_scale``, Granite's ``logits_scaling``, Gemma's ``final_logit_softcapping``); a model with a head field the
kernel does not know is refused by name, never given a silently different loss. Torch only (no Lightning).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_seqmem.messages import check_choice
from lightning_seqmem.training.adapters import is_peft_model
from lightning_seqmem.training.liger_cross_entropy import liger_linear_cross_entropy
from lightning_seqmem.training.linear_cross_entropy import DEFAULT_CHUNK_SIZE, linear_cross_entropy, linear_token_logps

CROSS_ENTROPY = ("auto", "full", "chunked", "liger")
AUTO_CHUNKED_LOGITS = 2**26
"""``"auto"`` picks ``"chunked"`` when the largest micro-batch's logits have at least this many elements
(``rows * length * vocab``): 256 MiB in fp32, which the full path holds about three times (the logits, their fp32
upcast and its gradient). Below it (a 4,096 vocabulary under 16,384 tokens, say) the whole logits cost less than
the chunks' loop, and ``"full"`` is kept."""
DEFAULT_AUTO_TOKENS = 4096  # tokens assumed when no DataModule says how large a micro-batch gets

# Config fields that change the head in ways the chunked kernel does not apply: refused by name.
UNSUPPORTED_HEAD_FIELDS = ("dim_model_base", "output_multiplier_scale", "lm_head_multiplier")


def check_cross_entropy(cross_entropy: Any, chunk_size: Any, choices: tuple[str, ...] = CROSS_ENTROPY) -> None:
    """A ``ValueError`` naming the option when ``cross_entropy`` is not one of ``choices`` or ``loss_chunk_size``
    is not an int >= 1."""
    check_choice("cross_entropy", cross_entropy, choices)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(
            f"loss_chunk_size={chunk_size!r} is not valid: tokens per chunk of the chunked loss, an int >= 1 "
            f"(e.g. {DEFAULT_CHUNK_SIZE})."
        )


def resolve_cross_entropy(cross_entropy: str, vocab_size: int | None, tokens: int | None) -> str:
    """The loss layer that runs: ``cross_entropy`` itself, or for ``"auto"`` ``"chunked"`` when ``tokens *
    vocab_size >= AUTO_CHUNKED_LOGITS`` (``tokens``: the largest micro-batch's ``rows * length``, else
    :data:`DEFAULT_AUTO_TOKENS`), else ``"full"``.

    Example::

        resolve_cross_entropy("auto", 151_936, 4096)  # 'chunked'
        resolve_cross_entropy("auto", 4096, 8 * 512)  # 'full'
    """
    if cross_entropy != "auto":
        return cross_entropy
    logits = (tokens or DEFAULT_AUTO_TOKENS) * (vocab_size or 0)
    return "chunked" if logits >= AUTO_CHUNKED_LOGITS else "full"


def check_liger(device: torch.device | str) -> None:
    """``cross_entropy="liger"`` before the first step: Liger-Kernel installed and a CUDA device, else an error
    that says which is missing and the fix."""
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        raise ImportError(
            "cross_entropy='liger' needs Liger-Kernel: `pip install liger-kernel` (CUDA and Triton), or use "
            "cross_entropy='chunked', which runs on every device."
        ) from None
    if torch.device(device).type != "cuda":
        raise ValueError(
            f"cross_entropy='liger' runs on a CUDA device only (Triton kernels), not on {torch.device(device)}: "
            "train on a GPU, or use cross_entropy='chunked'."
        )


def head_options(model: torch.nn.Module) -> dict[str, Any]:
    """What the chunked kernel needs besides the hidden states: the head's weight ``[vocab, hidden]`` and what the
    model's head does after the matmul (``head_bias``, ``logit_scale``, ``final_logit_softcapping``).

    Raises:
        ValueError: the config has a head field the kernel does not apply (named), or there is no linear head.
    """
    config = model.config
    for name in UNSUPPORTED_HEAD_FIELDS:
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ValueError(
                f"{type(config).__name__}.{name}={getattr(config, name)!r} changes the LM head's logits in a way the "
                "chunked loss does not apply: use cross_entropy='full' for this model."
            )
    head = model.get_output_embeddings()
    if hasattr(head, "base_layer"):  # a PEFT adapter on the head: the kernel would apply its base weight only
        raise ValueError("A LoRA adapter on the LM head is not applied by the chunked loss: use cross_entropy='full'.")
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(
            f"{type(model).__name__} has no linear LM head (get_output_embeddings() is {type(head).__name__}): "
            "use cross_entropy='full' for this model."
        )
    scale = getattr(config, "logit_scale", None)  # Cohere: logits * logit_scale
    scaling = getattr(config, "logits_scaling", None)  # Granite: logits / logits_scaling
    if scaling not in (None, 1, 1.0):
        scale = (1.0 if scale is None else float(scale)) / float(scaling)
    return {
        "head_weight": weight,
        "head_bias": getattr(head, "bias", None),
        "logit_scale": None if scale in (None, 1, 1.0) else float(scale),
        "final_logit_softcapping": getattr(config, "final_logit_softcapping", None),
    }


def decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The base model (hidden states out, no head) of a Hugging Face causal LM, also under a PEFT wrapper (whose
    own ``base_model`` is the tuner around the whole causal LM; the adapter layers sit inside the decoder)."""
    return (model.get_base_model() if is_peft_model(model) else model).base_model


def hidden_states(model: torch.nn.Module, inputs: dict[str, torch.Tensor], **kwargs: Any) -> torch.Tensor:
    """``[rows, length, hidden]`` last hidden states (after the final norm) of the base model on ``inputs``: the
    model's own forward without its head. ``kwargs`` as the model's forward passes them on (varlen arguments)."""
    return decoder(model)(**inputs, **kwargs, use_cache=False).last_hidden_state


def causal_lm_loss(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    labels: torch.Tensor,
    cross_entropy: str,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    num_items_in_batch: float | torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The causal-LM loss of ``model`` on ``inputs`` with unshifted ``labels`` (position ``t`` predicts label
    ``t + 1``), as the transformers loss computes it: the mean over label tokens, or with ``num_items_in_batch``
    their sum divided by it (``TokenLossNormalizer``).

    Args:
        model: a Hugging Face causal LM.
        inputs: its model inputs (``input_ids``, ``attention_mask``, ``position_ids``), ``[rows, length]``.
        labels: ``[rows, length]``, -100 where no loss is taken.
        cross_entropy: ``"full"``, ``"chunked"`` or ``"liger"`` (resolved: :func:`resolve_cross_entropy`).
        chunk_size: tokens per chunk of the chunked loss.
        num_items_in_batch: divide the summed loss by this instead of taking the mean.
        kwargs: passed to the model's forward (the flash varlen arguments).
    """
    if cross_entropy == "full":
        extra = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
        return model(**inputs, labels=labels, **extra, **kwargs, use_cache=False).loss
    head = head_options(model)
    hidden = hidden_states(model, inputs, **kwargs)[:, :-1]
    targets = labels[:, 1:]
    reduction = "mean" if num_items_in_batch is None else "sum"
    if cross_entropy == "liger":
        loss = liger_linear_cross_entropy(hidden, labels=targets, reduction=reduction, **head)
    else:
        loss = linear_cross_entropy(hidden, labels=targets, reduction=reduction, chunk_size=chunk_size, **head)
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def completion_token_logps(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    positions: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    **kwargs: Any,
) -> torch.Tensor:
    """``[N]`` fp32 log-probabilities of the next token at the ``N`` true ``positions`` (``[rows, length - 1]``
    bool: slot ``t`` scores ``input_ids[:, t + 1]``), by the chunked head: only those positions go through it."""
    head = head_options(model)
    hidden = hidden_states(model, inputs, **kwargs)[:, :-1][positions]
    targets = inputs["input_ids"][:, 1:][positions]
    return linear_token_logps(hidden, targets=targets, chunk_size=chunk_size, **head)
