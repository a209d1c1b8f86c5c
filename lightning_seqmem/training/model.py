"""``CausalLM``: a LightningModule around any Hugging Face causal language model.

It takes the batch dicts of :class:`~lightning_seqmem.SeqMemDataModule` (padded with ``attention_mask``, or packed
with ``position_ids``) and counts what matters for variable-length training: real (non-pad) tokens per second and
the fraction of the slots fed to the model that hold real tokens. It only wires: the model is built by
:mod:`~lightning_seqmem.training.building` (presets, configs, the position check), the optimizer and schedule come from
:mod:`~lightning_seqmem.training.optimization`, the loss layer (whole logits or chunked) from
:mod:`~lightning_seqmem.training.loss_layer` and the token-weighted loss from :mod:`~lightning_seqmem.training.loss`.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torchmetrics import MeanMetric
from typing_extensions import override

from lightning_seqmem._hparams import save_hyperparameters
from lightning_seqmem.batch import count_label_tokens
from lightning_seqmem.oom.hooks import SplitsOnOom
from lightning_seqmem.protocols import GivesMaxBatchShape, find_pad_token_id
from lightning_seqmem.training import adapter_checkpoints, adapters, checks, fsdp, fsdp_cpu
from lightning_seqmem.training.attention import AUTO, resolve_attn_implementation
from lightning_seqmem.training.building import (
    build_causal_lm,
    compile_options,
    datamodule_max_length,
    positions_problem,
)
from lightning_seqmem.training.linear_cross_entropy import DEFAULT_CHUNK_SIZE
from lightning_seqmem.training.loss import TokenLossNormalizer
from lightning_seqmem.training.loss_layer import (
    causal_lm_loss,
    check_cross_entropy,
    check_liger,
    decoder,
    head_options,
    resolve_cross_entropy,
)
from lightning_seqmem.training.optimization import check_optimizer, make_optimizer, no_decay_names, warmup_cosine
from lightning_seqmem.training.source_losses import SourceLosses
from lightning_seqmem.training.token_counts import TrainingTokenCounts
from lightning_seqmem.training.varlen import TORCH_VARLEN, batch_varlen_kwargs, needs_varlen_kwargs

MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "labels")
LOSS_NORMALIZATIONS = ("token", "micro_batch")


class CausalLM(SourceLosses, TrainingTokenCounts, SplitsOnOom, fsdp.FsdpAwareClipping, LightningModule):
    """Train a Hugging Face causal LM on padded or packed batches.

    Args:
        model_config: a preset name (``"tiny_llama"``, ``"tiny_gpt2"``) or a dict with ``model_type`` and config
            fields; the model gets random weights. Ignored when ``pretrained_path`` is given.
        pretrained_path: a local directory saved with ``save_pretrained`` to load weights from.
        vocab_size: vocabulary size; ``None`` takes it from the DataModule's tokenizer at ``setup``.
        pad_token_id: pad id, for a model used without a DataModule. With one, the DataModule owns the pad id
            (its ``pad_token_id``, else its tokenizer's) and ``setup`` takes it from there; the argument is kept
            out of ``hparams_initial`` so the two never log different values (Lightning refuses that).
        attn_implementation: ``"auto"``, ``"sdpa"``, ``"eager"``, ``"torch_varlen"``,
            ``"flash_attention_2"``/``"flash_attention_3"`` or a hub flash kernel. All keep packed documents apart
            (batches with ``position_ids`` and no ``attention_mask``): SDPA and eager through the block-diagonal
            mask transformers builds from ``position_ids``, flash and ``torch_varlen`` (torch's own varlen kernel,
            :mod:`lightning_seqmem.training.attention`) through the varlen arguments this module passes
            (:func:`~lightning_seqmem.training.varlen.batch_varlen_kwargs`; ``torch_varlen`` takes padded rows that way
            too, each run of padding its own segment). ``"auto"``: ``torch_varlen`` where it runs (CUDA,
            fp16/bf16 precision, torch >= 2.10), SDPA elsewhere, decided at ``setup``; ``"torch_varlen"`` where it
            cannot run is an error.
        loss_normalization: ``"token"``: every label token of an optimizer step weighs the same, across
            micro-batches (``accumulate_grad_batches``) and DDP ranks (Hugging Face's ``num_items_in_batch``);
            ``"micro_batch"``: each micro-batch's mean loss weighs the same (the old behaviour).
        learning_rate: peak AdamW learning rate.
        optimizer: ``"adamw"`` (torch's) or ``"adamw_8bit"`` (bitsandbytes' 8-bit moments, CUDA only; refused
            elsewhere with the fix; :mod:`~lightning_seqmem.training.optimization`).
        weight_decay: AdamW weight decay (not applied to biases and norm weights).
        betas: AdamW betas.
        warmup_ratio: fraction of optimizer steps with linear learning-rate warmup.
        min_lr_ratio: the cosine schedule decays to ``learning_rate * min_lr_ratio``.
        gradient_checkpointing: recompute activations in backward to save memory.
        compile: compile the Hugging Face model in place (``nn.Module.compile``: parameter names and checkpoints
            unchanged); packed batches stay exact under it (``tests/test_compile.py``). With a chunked loss the base
            model (what that path runs) is compiled too. ``True``: torch's defaults; or ``torch.compile``'s
            arguments as a mapping (``{"mode": "max-autotune"}``; :func:`~.building.compile_options`).
        cross_entropy: the loss layer (:mod:`~lightning_seqmem.training.loss_layer`). ``"full"``: the model's own
            head and loss over ``[rows, length, vocab]`` logits; ``"chunked"``: the head and loss chunk by chunk over
            the label tokens only, no whole logits (same loss and gradients within fp32 rounding); ``"liger"``:
            Liger-Kernel's fused kernel (installed, CUDA only); ``"auto"``: ``"chunked"`` when the largest
            micro-batch's logits hold at least ``2**26`` elements (rows x length x vocabulary, from the DataModule's
            ``max_batch_shape()`` at ``setup``, else 4,096 tokens), ``"full"`` below (tiny vocabularies).
        loss_chunk_size: tokens per chunk of the chunked loss.
        lora: a LoRA adapter through PEFT (``pip install lightning_seqmem[peft]``), e.g. ``dict(r=16, alpha=32,
            dropout=0.05, target_modules="all-linear")`` (:class:`~lightning_seqmem.training.adapters.LoraSettings`;
            ``quantize="nf4"``: QLoRA, a 4-bit base from ``pretrained_path`` on CUDA). Only the adapter trains and
            is in the optimizer; with ``pretrained_path`` checkpoints leave the frozen base out (it is loaded from
            there again). ``SaveAdapter`` writes the adapter in PEFT's format; ``merge_adapter(model.model)`` merges.
        on_oom: ``"raise"``: an out-of-memory error stops the run; ``"split"``: the micro-batch is run again in
            halves (a packed row cut between documents), its gradient unchanged, and later ones as large are split
            before they run (:mod:`~lightning_seqmem.oom.hooks`, ``docs/oom.md``).

    Example::

        model = CausalLM()  # tiny Llama, vocab size from the DataModule's tokenizer
        Trainer(max_steps=100).fit(model, datamodule=SeqMemDataModule())
    """

    passes_flash_varlen_kwargs = True  # lightning_seqmem.training.varlen.PassesFlashVarlen: forward adds them for flash

    def __init__(
        self,
        model_config: str | dict[str, Any] = "tiny_llama",
        pretrained_path: str | None = None,
        vocab_size: int | None = None,
        pad_token_id: int | None = None,
        attn_implementation: str = "sdpa",
        learning_rate: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_ratio: float = 0.05,
        min_lr_ratio: float = 0.1,
        gradient_checkpointing: bool = False,
        loss_normalization: str = "token",
        compile: bool | dict[str, Any] = False,
        cross_entropy: str = "auto",
        loss_chunk_size: int = DEFAULT_CHUNK_SIZE,
        lora: dict[str, Any] | None = None,
        optimizer: str = "adamw",
        on_oom: str = "raise",
    ) -> None:
        super().__init__()
        checks.positive_finite("learning_rate", learning_rate, "use e.g. 1e-4 (AdamW's usual range is 1e-5 to 1e-3)")
        if loss_normalization not in LOSS_NORMALIZATIONS:
            raise ValueError(f"loss_normalization must be one of {LOSS_NORMALIZATIONS}, got {loss_normalization!r}.")
        check_cross_entropy(cross_entropy, loss_chunk_size)
        check_optimizer(optimizer)
        adapters.resolve_lora(lora, pretrained_path)  # a bad key or value fails here, not at setup
        if not 0.0 <= warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {warmup_ratio}.")
        # The pad id belongs to the data: logged by the DataModule only, but kept in ``hparams`` for checkpoints.
        save_hyperparameters(self, ignore=["pad_token_id"])
        self.hparams.pad_token_id = pad_token_id
        self.model = None
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()  # as val_loss: synced over the ranks at the epoch's end
        self._init_token_counts(pad_token_id)
        self._token_loss = TokenLossNormalizer()
        self._no_decay: set[str] | None = None  # names, fixed at setup: FSDP flattens parameters to 1-D shards
        self._loss_layer: str | None = None  # cross_entropy as resolved ("auto" decided), at setup or first use
        self._init_oom(on_oom)
        if pretrained_path is not None or vocab_size is not None:
            self._build()

    # ----------------------------------------------------------------------------------------------- building
    def _build(self) -> None:
        hp = self.hparams
        self.model = build_causal_lm(
            hp.model_config,
            hp.pretrained_path,
            hp.vocab_size,
            hp.pad_token_id,
            hp.attn_implementation,
            hp.gradient_checkpointing,
            hp.get("compile"),
            hp.get("lora"),
        )
        trained, n = adapters.parameter_counts(self.model)
        rank_zero_info(
            f"[lightning_seqmem] {type(self.model).__name__}: {n / 1e6:.2f} M parameters, {trained / 1e6:.2f} M trained"
        )

    def setup(self, stage: str) -> None:
        """Take vocabulary size and pad id from the DataModule's tokenizer when they were not given; check that the
        DataModule's rows fit the model's positions; decide the attention and the loss layer."""
        dm = self.trainer.datamodule if self._trainer is not None else None
        tok = getattr(dm, "tokenizer", None)
        if tok is not None and self.hparams.vocab_size is None:
            self.hparams.vocab_size = len(tok)
        self._take_pad_token_id(dm, tok)
        if self.hparams.pad_token_id is not None:
            self.token_efficiency.pad_token_id = self.hparams.pad_token_id
        if self.model is None:
            if self.hparams.vocab_size is None:
                raise ValueError(
                    "CausalLM needs a vocabulary size: pass vocab_size=..., or train with a DataModule that has "
                    "a `tokenizer` attribute (e.g. SeqMemDataModule)."
                )
            self._build()
        if self._trainer is not None:  # bitsandbytes' kernels (QLoRA, the 8-bit optimizer) run on CUDA only
            hp, device = self.hparams, self.trainer.strategy.root_device
            fsdp_cpu.gather_full_state_dict_in_place(self.trainer.strategy)  # FSDP on CPU ranks: saving crashed
            fsdp.keep_buffers_fp32(self.trainer.strategy, self.model)  # FSDP mixed precision: rotary buffers in fp32
            adapters.check_quantization(adapters.resolve_lora(hp.get("lora"), hp.pretrained_path), device)
            check_optimizer(hp.get("optimizer", "adamw"), device)
        self._check_oom_strategy()
        self._choose_attention()
        self._check_positions(dm)
        checks.check_vocab_fits(self.model, tok, dm)
        self._choose_loss_layer(dm)
        self._no_decay = no_decay_names(self)

    def _choose_attention(self) -> None:
        """``"auto"``: the varlen kernel where it runs on the Trainer's device and precision, else SDPA;
        ``"torch_varlen"`` where it cannot run: a clear error before the first step."""
        requested = self.hparams.attn_implementation
        if requested not in (AUTO, TORCH_VARLEN) or self._trainer is None:
            return
        chosen = resolve_attn_implementation(requested, self.trainer.strategy.root_device, str(self.trainer.precision))
        if chosen != self.model.config._attn_implementation:
            self.model.set_attn_implementation(chosen)
        rank_zero_info(f"[lightning_seqmem] attn_implementation={requested!r}: {chosen}")

    def _take_pad_token_id(self, dm: Any, tok: Any) -> None:
        """The pad id from its owner, the data: the DataModule's ``pad_token_id`` (pre-tokenized data give it
        without a tokenizer), else its tokenizer's. A different id given to the model loses, with a warning."""
        data_pad = find_pad_token_id(dm, tok)
        if data_pad is None:
            return
        own = self.hparams.pad_token_id
        if own is not None and own != data_pad:
            rank_zero_warn(
                f"CausalLM was given pad_token_id={own} but the DataModule pads with {data_pad}; using "
                f"{data_pad}. The pad id belongs to the data: give it there (data.pad_token_id) only."
            )
        self.hparams.pad_token_id = data_pad

    def _check_positions(self, dm: Any) -> None:
        """Refuse, before the first step, rows longer than a learned position table (a torch IndexError otherwise);
        warn when they only exceed the positions the model was configured (or trained) for."""
        problem = positions_problem(self.model, datamodule_max_length(dm))
        if problem is None:
            return
        message, fatal = problem
        if fatal:
            raise ValueError(message)
        rank_zero_warn(message)

    def _choose_loss_layer(self, dm: Any) -> None:
        """Decide ``cross_entropy="auto"`` on the largest micro-batch the DataModule yields; check ``"liger"``'s
        package and device; compile the base model a chunked loss runs (``compile=True``)."""
        shape = dm.max_batch_shape() if isinstance(dm, GivesMaxBatchShape) else None
        tokens = int(shape[0]) * int(shape[1]) if shape is not None else None
        requested = self.hparams.get("cross_entropy", "auto")
        self._loss_layer = resolve_cross_entropy(requested, self.model.config.vocab_size, tokens)
        if self._loss_layer == "liger":
            check_liger(self.trainer.strategy.root_device if self._trainer is not None else self.device)
        if self._loss_layer != "full":
            head_options(self.model)  # a head the chunked kernel cannot apply: refused before the first step
            base = decoder(self.model)
            options = compile_options(self.hparams.get("compile"))
            if options is not None and base is not self.model and base._compiled_call_impl is None:
                base.compile(**options)
        if requested == "auto":
            rank_zero_info(f"[lightning_seqmem] cross_entropy='auto': {self._loss_layer}")

    @property
    def loss_layer(self) -> str:
        """The loss layer that runs (``cross_entropy`` with ``"auto"`` decided; without ``setup``, on 4,096 tokens)."""
        if self._loss_layer is None:
            self._loss_layer = resolve_cross_entropy(
                self.hparams.get("cross_entropy", "auto"), self.model.config.vocab_size, None
            )
        return self._loss_layer

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """With an adapter on a ``pretrained_path`` base, the frozen base is left out (loaded from there again)."""
        if self.hparams.get("pretrained_path") is not None:
            adapter_checkpoints.drop_frozen_base(self, checkpoint)
        self._save_oom_state(checkpoint)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        adapter_checkpoints.restore_frozen_base(self, checkpoint)  # the base left out, from pretrained_path's model
        self._load_oom_state(checkpoint)  # on_oom="split": the size that failed, remembered

    # ------------------------------------------------------------------------------------------------- steps
    def forward(self, batch: dict[str, torch.Tensor], **kwargs: Any):
        """Run the model on the batch's model keys; ``kwargs`` go to the model (e.g. ``num_items_in_batch``)."""
        inputs = {k: batch[k] for k in MODEL_KEYS if k in batch}
        if self._needs_varlen(inputs):
            # Host syncs (the segment table is data-dependent: its nonzero and its longest segment), at the start of
            # the step, where the device has nothing queued behind it; transformers' own mask building does the same.
            kwargs.update(batch_varlen_kwargs(inputs))
        return self.model(**inputs, **kwargs, use_cache=False)

    def loss(self, batch: dict[str, torch.Tensor], num_items_in_batch: float | None = None) -> torch.Tensor:
        """The batch's causal-LM loss through the chosen loss layer (:attr:`loss_layer`): the mean over its label
        tokens, or their sum divided by ``num_items_in_batch``; the same value whichever layer runs."""
        inputs = {k: batch[k] for k in MODEL_KEYS if k in batch and k != "labels"}
        extra = batch_varlen_kwargs(inputs) if self._needs_varlen(inputs) else {}
        return causal_lm_loss(
            self.model,
            inputs,
            batch["labels"],
            self.loss_layer,
            self.hparams.get("loss_chunk_size", DEFAULT_CHUNK_SIZE),
            num_items_in_batch,
            **extra,
        )

    def _needs_varlen(self, inputs: dict[str, torch.Tensor]) -> bool:
        """Whether ``inputs`` need the varlen arguments for the attention that runs (``varlen.needs_varlen_kwargs``)."""
        return needs_varlen_kwargs(getattr(self.model.config, "_attn_implementation", None), inputs)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        rows, token = batch["input_ids"].shape[0], self.hparams.loss_normalization == "token"
        # "token": sum of token losses / a fixed scale; on_after_backward turns the step into the per-token mean
        items = self._token_loss.add(batch["labels"]) if token else None
        if self.splitting:  # each part's share of the micro-batch's loss, backward done here
            whole = items if token else count_label_tokens(batch)
            loss = self.split_backward(batch, batch_idx, lambda part: (self.loss(part, whole), {})).loss
        else:
            loss = self.loss(batch, num_items_in_batch=items)
        if token:
            self._token_loss.add_loss(loss)
        else:
            self._log_train_loss(loss, batch_size=rows)
        self._count_train_tokens(batch, rows)
        return loss

    def _log_train_loss(self, loss: torch.Tensor, batch_size: int | None = None) -> None:
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size)
        self.log("train/ppl", torch.exp(loss.detach().clamp(max=50)), batch_size=batch_size)

    @override
    def on_train_start(self) -> None:
        self._token_loss.reset()  # a fit stopped mid-step must not carry its tokens over

    @override
    def on_after_backward(self) -> None:
        """Token loss: after the step's last backward, rescale its gradients to the per-token mean over
        micro-batches and ranks, so that every ``on_before_optimizer_step`` hook, clipping and the optimizer see
        them; log the step's true per-token loss. Nothing waits for the device."""
        if self._oom is not None:
            self._oom_after_backward()  # DDP: the window's gradient averaged once, before the rescale
        if self.hparams.loss_normalization == "token":
            loss = self._token_loss.finish_step(self)
            if loss is not None:
                self._log_train_loss(loss, batch_size=1)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # Weight by predicted tokens so the epoch loss is the per-token loss, whatever the batch composition.
        n = count_label_tokens(batch)
        loss = self.evaluation_loss(batch, n, "validation")
        self.val_loss.update(loss.detach(), weight=n)
        self.log("val/loss", self.val_loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def on_validation_epoch_end(self) -> None:
        # val_loss is computed (and synced across ranks) by the log call; read it once more for perplexity.
        self.log_source_losses()  # a Mix: val/loss/<name>, from the sums kept on the device
        value = self.trainer.callback_metrics.get("val/loss")
        if value is not None:
            self.log("val/ppl", torch.exp(value.clamp(max=50)), sync_dist=True)  # equal on every rank, as above

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # As validation: the per-token loss over every rank's test tokens (logged as is, it was this rank's alone).
        n = count_label_tokens(batch)
        loss = self.evaluation_loss(batch, n, "test")
        self.test_loss.update(loss.detach(), weight=n)
        self.log("test/loss", self.test_loss, batch_size=batch["input_ids"].shape[0])
        return loss

    # --------------------------------------------------------------------------------------------- optimizer
    def configure_optimizers(self):
        hp, names = self.hparams, self._no_decay if self._no_decay is not None else no_decay_names(self)
        choice = hp.get("optimizer", "adamw")  # checkpoints written before the option have none
        optimizer = make_optimizer(choice, self.named_parameters(), names, hp.learning_rate, hp.weight_decay, hp.betas)
        scheduler = warmup_cosine(optimizer, self.trainer.estimated_stepping_batches, hp.warmup_ratio, hp.min_lr_ratio)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
