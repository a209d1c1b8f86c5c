"""``DPO``: a small preference LightningModule — the sigmoid DPO loss against a frozen reference.

It takes the pair batches of :class:`~lightning_seqmem.SeqMemDataModule` on preference data, padded (TRL's
``[2B, L]`` layout) or packed (whole pairs per row, ``sequence_index``), and gets per-pair completion
log-probabilities from both with one helper (``preference_loss.sequence_logps``). The reference is a frozen copy of
the policy taken at ``setup`` (``reference="copy"``; with a LoRA adapter, ``lora=...``, the base with the adapter
disabled, as TRL does: no copy), or log-probabilities precomputed into the dataset (``ref_chosen_logps`` /
``ref_rejected_logps`` columns, ``reference="precomputed"``: no second model in memory).
Model building, attention selection, the pad id, the optimizer and the loss layer (``cross_entropy``: whole logits,
or the head chunk by chunk over the completion tokens only) are ``CausalLM``'s.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from typing_extensions import override

from lightning_seqmem._hparams import save_hyperparameters
from lightning_seqmem.batch import REF_LOGPS_KEYS
from lightning_seqmem.messages import check_choice
from lightning_seqmem.oom import fsdp as oom_fsdp
from lightning_seqmem.oom.split import pair_count, pairs_on_device
from lightning_seqmem.training import checks
from lightning_seqmem.training.adapters import is_peft_model
from lightning_seqmem.training.loss_layer import completion_token_logps
from lightning_seqmem.training.model import CausalLM
from lightning_seqmem.training.preference_loss import (
    completion_positions,
    dpo_loss,
    sequence_logps,
    sequence_logps_of_tokens,
)
from lightning_seqmem.training.varlen import batch_varlen_kwargs

REFERENCES = ("copy", "precomputed")
CROSS_ENTROPY = ("auto", "full", "chunked")  # Liger's kernel gives a loss, not the per-token log-probabilities DPO sums
INPUT_KEYS = ("input_ids", "attention_mask", "position_ids")


class DPO(CausalLM):
    """Direct preference optimisation (sigmoid loss, TRL's ``loss_type="sigmoid"``) on pair batches.

    Args:
        beta: DPO's inverse temperature (larger keeps the policy nearer the reference).
        label_smoothing: assumed share of flipped preferences (conservative DPO), in ``[0, 0.5)``.
        reference: ``"copy"``: a frozen copy of the policy, taken at ``setup`` (its weights then; a second model in
            memory; with ``lora=...`` the base with the adapter disabled instead, which is the policy at setup when
            the adapter starts at zero, as PEFT's does); ``"precomputed"``: the batch's ``ref_chosen_logps`` /
            ``ref_rejected_logps`` (dataset columns of the same names). Precomputed values in a batch are used under
            ``"copy"`` too.
        **kwargs: ``CausalLM``'s arguments (model, attention, optimizer, ``cross_entropy`` and
            ``loss_chunk_size``); the loss is a mean over pairs, so ``loss_normalization`` is always
            ``"micro_batch"``. ``cross_entropy="chunked"`` runs the head on the completion tokens only, chunk by
            chunk, for the policy and the reference alike; ``"liger"`` is not offered (its kernel returns a loss,
            not per-token log-probabilities). ``on_oom="split"`` splits a micro-batch by whole pairs.

    Example::

        dm = SeqMemDataModule("builtin_preference", max_length=128, strategy="pack")
        Trainer(max_steps=20).fit(DPO(beta=0.1), datamodule=dm)
    """

    def __init__(self, beta: float = 0.1, label_smoothing: float = 0.0, reference: str = "copy", **kwargs: Any) -> None:
        check_choice("reference", reference, REFERENCES)
        check_choice("cross_entropy", kwargs.get("cross_entropy", "auto"), CROSS_ENTROPY)
        checks.positive_finite("beta", beta, "use e.g. 0.1 (TRL's default)")
        dpo_loss(*torch.zeros(4, 1), beta=beta, label_smoothing=label_smoothing)  # the loss checks its arguments
        kwargs["loss_normalization"] = "micro_batch"
        super().__init__(**kwargs)
        save_hyperparameters(self, "beta", "label_smoothing", "reference")
        self.reference_model: torch.nn.Module | None = None

    @override
    def setup(self, stage: str) -> None:
        """Refuse data that are not preference pairs (the loss reads pair batches), then ``CausalLM``'s setup and
        the frozen reference copy."""
        checks.check_preference_data(self.trainer.datamodule if self._trainer is not None else None)
        super().setup(stage)
        if self.hparams.reference == "copy" and self.reference_model is None and not is_peft_model(self.model):
            self.reference_model = copy.deepcopy(self.model).requires_grad_(False)

    @override
    def _oom_one_token(self) -> torch.Tensor:
        """``on_oom="split"`` under FSDP: the frozen copy's units gathered with the policy's (its forward runs in
        the parts too)."""
        if self.reference_model is not None:
            with torch.no_grad():
                oom_fsdp.one_token_loss(self.reference_model, self.trainer.strategy.root_device)
        return super()._oom_one_token()

    def sequence_logps(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(chosen, rejected)`` ``[pairs]`` completion log-probabilities of ``model`` on the batch (padded or
        packed; varlen arguments as ``CausalLM.forward`` passes them), through the chosen loss layer: the whole
        logits, or the head chunk by chunk over the completion tokens only."""
        inputs = {k: batch[k] for k in INPUT_KEYS if k in batch}
        extra = batch_varlen_kwargs(inputs) if self._needs_varlen(inputs) else {}
        if self.loss_layer == "full":
            return sequence_logps(model(**inputs, **extra, use_cache=False).logits, batch)
        positions = completion_positions(batch)
        logps = completion_token_logps(model, inputs, positions, self.hparams.loss_chunk_size, **extra)
        return sequence_logps_of_tokens(logps, batch, positions)

    def reference_logps(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(chosen, rejected)`` ``[pairs]`` reference log-probabilities: the batch's precomputed values, else the
        frozen copy's or the base's with the adapter disabled (no gradient)."""
        if all(key in batch for key in REF_LOGPS_KEYS):
            return tuple(batch[key].to(torch.float64) for key in REF_LOGPS_KEYS)
        adapter = self.hparams.reference == "copy" and is_peft_model(self.model)
        if self.reference_model is None and not adapter:
            raise ValueError(
                f"reference='precomputed' but the batch has no {list(REF_LOGPS_KEYS)}: add those "
                "columns to the dataset, or use reference='copy'."
            )
        # Eval mode for its forward only (no dropout): left in the module's mode otherwise, so Lightning does not
        # report modules in eval mode at the start of every fit.
        reference = self.model if adapter else self.reference_model
        mode = reference.training
        try:
            with torch.no_grad(), reference.disable_adapter() if adapter else contextlib.nullcontext():
                return self.sequence_logps(reference.eval(), batch)
        finally:
            reference.train(mode)

    def pair_loss(
        self, batch: dict[str, torch.Tensor], pairs: int | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The mean DPO loss over the batch's pairs and the values to log (reward margin and accuracy); with
        ``pairs``, their sums over the batch divided by ``pairs`` instead (a part's share of a split micro-batch)."""
        checks.check_pair_batch(batch)
        chosen, rejected = self.sequence_logps(self.model, batch)
        out = dpo_loss(
            chosen,
            rejected,
            *self.reference_logps(batch),
            beta=self.hparams.beta,
            label_smoothing=self.hparams.label_smoothing,
        )
        margin = out.chosen_rewards - out.rejected_rewards
        if pairs is None:
            return out.losses.mean().float(), {
                "reward_margin": margin.mean().float(),
                "reward_accuracy": (margin > 0).float().mean(),
            }
        return out.losses.sum().float() / pairs, {
            "reward_margin": margin.sum().float() / pairs,
            "reward_accuracy": (margin > 0).float().sum() / pairs,
        }

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.splitting:  # on_oom="split": each part's share of the mean over pairs, backward done here
            pairs = pair_count(batch)
            out = self.split_backward(batch, batch_idx, lambda part: self.pair_loss(part, pairs))
            loss, values = out.loss, out.extras
        else:
            loss, values = self.pair_loss(batch)
        rows = batch["input_ids"].shape[0]
        self._count_train_tokens(batch, rows)
        self.log("train/loss", loss, prog_bar=True, batch_size=rows)
        for name, value in values.items():
            self.log(f"train/{name}", value, batch_size=rows)
        return loss

    def evaluation_pair_loss(self, batch: dict[str, torch.Tensor], stage: str) -> tuple[torch.Tensor, dict]:
        """:meth:`pair_loss` of an evaluation batch; with ``on_oom="split"`` in parts of whole pairs where needed."""
        if not self.splitting:
            return self.pair_loss(batch)
        pairs = pair_count(batch)
        out = self.split_evaluate(batch, lambda part: self.pair_loss(part, pairs), stage)
        return out.loss, out.extras

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """``val/loss``: the mean over every rank's validation pairs (``CausalLM``'s synced ``val_loss`` metric, each
        batch weighted by its pairs, so also the pair-weighted mean of a ``Mix``'s ``val/loss/<name>``); logged as
        this rank's own mean, it was half the validation set's on two ranks, and differed from rank to rank."""
        loss, values = self.evaluation_pair_loss(batch, "validation")
        rows = batch["input_ids"].shape[0]
        self.val_loss.update(loss.detach(), weight=self._source_loss_weight(batch))
        self.log("val/loss", self.val_loss, prog_bar=True, batch_size=rows)
        for name, value in values.items():
            self.log(f"val/{name}", value, batch_size=rows, sync_dist=True)
        return loss

    @override
    def on_validation_epoch_end(self) -> None:
        """A ``Mix``'s ``val/loss/<name>`` per source (``SourceLosses``); no perplexity: the DPO loss is not a
        language-model loss."""
        self.log_source_losses()

    @override
    def _source_loss_weight(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """A batch's pairs, on the device (packed: its sequences, two per pair)."""
        return pairs_on_device(batch)

    @override
    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _ = self.evaluation_pair_loss(batch, "test")
        self.test_loss.update(loss.detach(), weight=self._source_loss_weight(batch))  # every rank's pairs
        self.log("test/loss", self.test_loss, batch_size=batch["input_ids"].shape[0])
        return loss
