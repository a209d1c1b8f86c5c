"""Per-pair completion log-probabilities and the sigmoid DPO loss, for padded and packed pair batches alike.

A padded pair batch (``batching.preference.PreferenceCollator``, TRL's layout) holds one sequence per row, the
chosen rows first; a packed one (``batching.pair_packing.PackedPairCollator``) holds several per row and says which
with ``sequence_index``, numbered like the padded rows. Either way :func:`sequence_logps` sums each sequence's
completion log-probabilities and splits them into chosen and rejected, so one loss serves both layouts;
:func:`sequence_logps_of_tokens` does the same from the completion tokens' log-probabilities alone (the chunked
head, ``loss_layer.completion_token_logps``, computes only those).

Torch only. The key names are the batch contract's (``batch.COMPLETION_MASK``, ``batch.SEQUENCE_INDEX``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from lightning_seqmem.batch import COMPLETION_MASK, SEQUENCE_INDEX


def token_logps(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``[batch, seq - 1]`` log-probability of each next token: slot ``t`` scores ``input_ids[:, t + 1]``.

    In fp32 whatever the logits' dtype (a sum over hundreds of tokens in bf16 loses the difference DPO needs).
    """
    rows, length, vocab = logits.shape
    nll = F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), input_ids[:, 1:].reshape(-1), reduction="none")
    return -nll.view(rows, length - 1)


def sequence_logps(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of each sequence's completion log-probabilities, split into ``(chosen, rejected)``, ``[pairs]`` float64.

    Args:
        logits: ``[batch, seq, vocab]`` the model's output on ``batch``.
        batch: a padded pair batch (``input_ids``, ``completion_mask``; rows ``0..P-1`` chosen, ``P..2P-1``
            rejected) or a packed one (with ``sequence_index``: one host sync, for the number of sequences).

    Example::

        chosen, rejected = sequence_logps(model(**model_inputs).logits, batch)
    """
    mask = completion_positions(batch)
    # Summed in float64: a sum of hundreds of terms near -1..-10 rounds by ~1e-5 in fp32, more than the two layouts
    # differ by (their per-token values agree within 1e-6), and the layouts add in different orders.
    per_token = token_logps(logits, batch["input_ids"]).masked_fill(~mask, 0.0).double()
    if SEQUENCE_INDEX not in batch:
        sums = per_token.sum(dim=1)
    else:
        index = batch[SEQUENCE_INDEX]
        sequences = int(index.max()) + 1
        # Padding (-1) lands on sequence 0 with a zero weight: its slots are masked above.
        sums = per_token.new_zeros(sequences).index_add_(
            0, index[:, 1:].clamp(min=0).reshape(-1), per_token.reshape(-1)
        )
    return split_pairs(sums)


def completion_positions(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[batch, seq - 1]`` bool: the slots whose next token is a completion token (slot ``t`` scores token
    ``t + 1``), the only ones DPO sums."""
    return batch[COMPLETION_MASK][:, 1:].bool()


def sequence_logps_of_tokens(
    logps: torch.Tensor, batch: dict[str, torch.Tensor], positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sequence_logps` from the ``[N]`` log-probabilities of the ``N`` true ``positions`` alone (row-major
    order, as ``tensor[positions]`` gives them), ``positions`` from :func:`completion_positions`.

    Example::

        positions = completion_positions(batch)
        chosen, rejected = sequence_logps_of_tokens(completion_token_logps(model, inputs, positions), batch, positions)
    """
    if SEQUENCE_INDEX not in batch:
        rows, slots = positions.shape
        sequences = rows
        owner = torch.arange(rows, device=positions.device)[:, None].expand(rows, slots)
    else:
        index = batch[SEQUENCE_INDEX]
        sequences = int(index.max()) + 1
        owner = index[:, 1:].clamp(min=0)  # as sequence_logps: padding (-1) on sequence 0
    sums = logps.new_zeros(sequences, dtype=torch.float64).index_add_(0, owner[positions], logps.double())
    return split_pairs(sums)


def split_pairs(sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[2P]`` per-sequence values (chosen first) as ``(chosen, rejected)``; an odd count is an error."""
    if sums.numel() % 2:
        raise ValueError(f"{sums.numel()} sequences in a pair batch: expected chosen and rejected for every pair.")
    chosen, rejected = sums.chunk(2)
    return chosen, rejected


class DPOLoss(NamedTuple):
    """Per-pair outputs of :func:`dpo_loss`, ``[pairs]`` each; rewards are detached (for logging)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> DPOLoss:
    """The sigmoid DPO loss: ``-log σ(β ((π_c - ref_c) - (π_r - ref_r)))`` per pair (TRL's ``loss_type="sigmoid"``).

    Args:
        policy_chosen, policy_rejected, ref_chosen, ref_rejected: ``[pairs]`` sequence log-probabilities
            (:func:`sequence_logps`; the reference ones without gradient).
        beta: the inverse temperature; larger keeps the policy closer to the reference.
        label_smoothing: the assumed share of flipped labels (conservative DPO), in ``[0, 0.5)``.

    Raises:
        ValueError: ``beta <= 0`` or ``label_smoothing`` outside ``[0, 0.5)``.

    Example::

        out = dpo_loss(*sequence_logps(logits, batch), batch["ref_chosen_logps"], batch["ref_rejected_logps"])
        out.losses.mean().backward()
    """
    if beta <= 0:
        raise ValueError(f"beta={beta} must be > 0.")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 0.5).")
    chosen_ratio, rejected_ratio = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    margin = beta * (chosen_ratio - rejected_ratio)
    losses = -(1 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)
    return DPOLoss(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
