"""Config checks: warn at setup about configurations known to waste memory or fail, and ``resolve_precision``.

The checks are a pure function, :func:`find_problems`, on :class:`RunFacts` (plain values); the
:class:`ConfigChecks` callback only gathers those facts from any Trainer, DataModule and model, defensively.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_seqmem.memory.allocator import expandable_segments_on
from lightning_seqmem.memory.loss_watch import LossWatch, nonfinite_loss_message
from lightning_seqmem.memory.model_facts import model_facts
from lightning_seqmem.memory.preallocate import CachePreallocator
from lightning_seqmem.protocols import DescribesBatching, GivesBatchKeys, GivesMaxBatchShape, GivesWarmupShape
from lightning_seqmem.training.adapters import find_peft_model
from lightning_seqmem.training.varlen import PassesFlashVarlen, is_flash_attention

CHECKS = (
    "eval_batch_size",
    "batch_size",
    "fp16_packing",
    "fp16_full_finetuning",
    "fp8_compile",
    "packing_attention",
    "flash_varlen",
    "dynamic_shapes",
    "stream_validation",
)
ALL_CHECKS = CHECKS + ("memory", "nonfinite_loss")  # find_problems' checks on RunFacts, and ConfigChecks' own


def resolve_precision(precision: str = "auto") -> str:
    """``"auto"`` -> ``"bf16-mixed"`` on a GPU that supports bf16, ``"16-mixed"`` on other GPUs, ``"32-true"``
    without CUDA; any other value is returned unchanged.

    Args:
        precision: a Lightning precision string, or ``"auto"``.

    Example::

        Trainer(precision=resolve_precision("auto"))
    """
    if precision != "auto":
        return precision
    if not torch.cuda.is_available():
        return "32-true"
    return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"


def packed_safe_attention() -> frozenset[str]:
    """Attention implementations that can keep packed documents apart given ``position_ids`` and no
    ``attention_mask``.

    ``transformers`` with ``masking_utils.find_packed_sequence_indices`` builds a block-diagonal mask for eager,
    sdpa and flex from ``position_ids``, whatever the batch size. Flash attention infers documents from
    ``position_ids`` only in one-row batches; with more rows it needs the varlen arguments
    (:func:`~lightning_seqmem.training.varlen.flash_varlen_kwargs`), which the ``flash_varlen`` check asks for.
    """
    # torch_varlen reads the varlen arguments or, without them, position_ids itself
    # (lightning_seqmem.training.attention)
    safe = {"flash_attention_2", "flash_attention_3", "torch_varlen"}
    try:
        from transformers import masking_utils

        if hasattr(masking_utils, "find_packed_sequence_indices"):
            safe |= {"eager", "sdpa", "flex_attention", "auto"}  # auto is torch_varlen or sdpa
    except ImportError:
        pass
    return frozenset(safe)


@dataclass(frozen=True)
class RunFacts:
    """What the checks need to know about a run; ``None`` means unknown (the check then stays quiet)."""

    on_cuda: bool = False
    precision: str = "32-true"
    micro_batch_size: int | None = None
    eval_batch_size: int | None = None
    batch_size: int | None = None
    accumulate_grad_batches: int = 1
    world_size: int = 1
    packing: bool = False
    dynamic_shapes: bool = False
    attn_implementation: str | None = None
    flash_varlen: bool = False
    fp16_weights: bool = False
    adapter: bool = False  # the module trains a PEFT adapter on a frozen base
    compiled: bool = False
    preallocating: bool = False
    expandable_segments: bool = False
    streaming: bool = False
    val_check_interval: int | float | None = None
    validating: bool = True


def find_problems(facts: RunFacts, safe_attention: frozenset[str] | None = None) -> dict[str, str]:
    """Check name -> warning with the fix, for each known problem in ``facts``.

    Args:
        facts: the run's configuration.
        safe_attention: attention implementations that keep packed documents apart (default
            :func:`packed_safe_attention`).

    Example::

        find_problems(RunFacts(micro_batch_size=8, eval_batch_size=32))  # {'eval_batch_size': '...'}
    """
    safe = packed_safe_attention() if safe_attention is None else safe_attention
    problems = {}
    micro, eval_bs = facts.micro_batch_size, facts.eval_batch_size
    if micro is not None and eval_bs is not None and micro != eval_bs:
        problems["eval_batch_size"] = (
            f"eval_batch_size={eval_bs} differs from micro_batch_size={micro}: the memory profile changes between "
            "training and validation, so a run can fit in training and fail at its first validation (or waste "
            "memory held for the other phase). Set eval_batch_size equal to micro_batch_size (or leave it None)."
        )
    if facts.batch_size is not None:
        effective = (micro or facts.batch_size) * facts.accumulate_grad_batches * facts.world_size
        if micro is not None and facts.batch_size != effective:
            problems["batch_size"] = (
                f"batch_size={facts.batch_size} does not match micro_batch_size={micro} x accumulate_grad_batches="
                f"{facts.accumulate_grad_batches} x world_size={facts.world_size} = {effective}. Set micro_batch_size "
                "(rows per device step, what memory depends on) and Trainer(accumulate_grad_batches=...) instead."
            )
        elif micro is None and facts.accumulate_grad_batches > 1:
            problems["batch_size"] = (
                f"batch_size={facts.batch_size} is used per micro-batch, so with accumulate_grad_batches="
                f"{facts.accumulate_grad_batches} the effective batch is {effective}. If {facts.batch_size} was meant "
                "as the effective batch, give micro_batch_size = batch_size / (accumulate_grad_batches x world_size)."
            )
    flash = is_flash_attention(facts.attn_implementation)
    fp16_full = facts.precision.startswith("16-true") or facts.fp16_weights
    if fp16_full and facts.packing and facts.attn_implementation is not None and not flash:
        problems["fp16_packing"] = (
            f"fp16 weights ({facts.precision}, no fp32 master copy) with packing and attn_implementation="
            f"{facts.attn_implementation!r}: known to fail with dtype mismatches in the packed-sequence "
            "attention path (and fp16 weights without a master copy lose small updates). Use "
            "precision='bf16-mixed' (or '16-mixed'), or attn_implementation='flash_attention_2'."
        )
    if fp16_full and not facts.adapter:
        problems["fp16_full_finetuning"] = (
            f"full fine-tuning with fp16 weights ({facts.precision}): without an fp32 master copy an update smaller "
            "than fp16's step at a weight's magnitude rounds away. Train a LoRA "
            "adapter on the frozen base instead (CausalLM(lora=dict(r=16)); peft.get_peft_model for a module of your "
            "own): gradients and optimizer state for the adapter only. Or use precision='bf16-mixed' where the GPU "
            "has bf16, or '16-mixed' (fp32 master weights: AdamW then holds 16 bytes per parameter)."
        )
    if facts.precision.startswith("transformer-engine") and not facts.compiled:
        problems["fp8_compile"] = (
            f"precision={facts.precision!r} (fp8 via Transformer Engine) without torch.compile: the casts and "
            "amax bookkeeping around every fp8 layer stay unfused, so most of the memory and speed benefit is lost. "
            "Compile the model "
            "(torch.compile / model.compile()) or use precision='bf16-mixed'."
        )
    if facts.packing and facts.attn_implementation is not None and facts.attn_implementation not in safe and not flash:
        problems["packing_attention"] = (
            f"packing with attn_implementation={facts.attn_implementation!r}, which cannot keep the documents in a "
            f"packed row apart (they would attend to each other). Use one of {sorted(safe)}, or strategy='pad'."
        )
    several_rows = micro is None or micro > 1 or (eval_bs or 1) > 1 or facts.dynamic_shapes
    if facts.packing and flash and several_rows and not facts.flash_varlen:
        problems["flash_varlen"] = (
            f"packing with attn_implementation={facts.attn_implementation!r} and batches of more than one row "
            f"(micro_batch_size={micro}, or eval_batch_size, or a warmup that reshapes rows): transformers separates "
            "packed documents for flash attention only in one-row batches, so without the varlen arguments the "
            "documents of a row attend to each other. In the module's step call "
            "model(**batch, **flash_varlen_kwargs(batch['position_ids'])) (lightning_seqmem.training.varlen; CausalLM "
            "does) and set `passes_flash_varlen_kwargs = True` on the module, or use attn_implementation='sdpa'."
        )
    if facts.streaming and facts.world_size > 1 and facts.validating and isinstance(facts.val_check_interval, float):
        problems["stream_validation"] = (
            f"a streamed training split under {facts.world_size} processes repeats so that no rank runs out first: "
            f"its epoch never ends, and with val_check_interval={facts.val_check_interval} (a share of the epoch) "
            "validation never runs. Give Trainer(val_check_interval=<steps>) an integer, and stop with max_steps."
        )
    if facts.on_cuda and facts.dynamic_shapes and not (facts.preallocating or facts.expandable_segments):
        problems["dynamic_shapes"] = (
            "batch shapes change from step to step on CUDA without pre-allocation or expandable segments: the "
            "caching allocator fragments, reserved memory creeps up, and an OOM can come hours in. Add "
            "CachePreallocator() to the callbacks and call lightning_seqmem.memory.allocator.configure_allocator() "
            "before importing torch, or use constant shapes (strategy='truncate')."
        )
    return problems


def _setting(obj: object, name: str) -> object:
    """``obj.name``, else ``obj.hparams[name]``, else ``None``."""
    value = getattr(obj, name, None)
    if value is None:
        hparams = getattr(obj, "hparams", None)
        try:
            value = hparams.get(name) if hparams is not None else None
        except AttributeError:
            value = getattr(hparams, name, None)
    return value


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _batch_size(dm: object) -> int | None:
    """A DataModule's ``batch_size``, unless it is ``micro_batch_size`` under another name: ``SeqMemDataModule``
    answers to the name Lightning's batch-size finder looks for with its micro-batch, which is no effective batch
    to hold against micro_batch_size x accumulation x ranks (that warned on every DDP or accumulating run)."""
    value = _int_or_none(_setting(dm, "batch_size"))
    alias = isinstance(getattr(type(dm), "batch_size", None), property)
    return None if alias and value == _setting(dm, "micro_batch_size") else value


def gather_facts(trainer: Trainer, pl_module: LightningModule) -> RunFacts:
    """Read :class:`RunFacts` from any Trainer, DataModule and LightningModule (missing attributes are unknown)."""
    dm = trainer.datamodule
    batching = dm if isinstance(dm, DescribesBatching) else None  # else unknown: those checks stay quiet
    warmup = any(isinstance(cb, GivesWarmupShape) for cb in trainer.callbacks)
    # any loader whose batches change shape (padded to their longest row, a token budget), or a warmup that grows
    # the length
    dynamic = (batching is not None and not batching.constant_shapes()) or warmup
    model = model_facts(pl_module)
    trainable = [p for p in pl_module.parameters() if p.requires_grad]
    return RunFacts(
        on_cuda=trainer.strategy.root_device.type == "cuda",
        precision=str(trainer.precision),
        micro_batch_size=_int_or_none(_setting(dm, "micro_batch_size")) if dm is not None else None,
        eval_batch_size=_int_or_none(_setting(dm, "eval_batch_size")) if dm is not None else None,
        batch_size=_batch_size(dm) if dm is not None else None,
        accumulate_grad_batches=int(trainer.accumulate_grad_batches),
        world_size=int(trainer.world_size),
        packing=batching is not None and batching.packs_documents(),
        dynamic_shapes=dynamic,
        attn_implementation=model.attn_implementation,
        flash_varlen=isinstance(pl_module, PassesFlashVarlen) and pl_module.passes_flash_varlen_kwargs is True,
        fp16_weights=bool(trainable) and all(p.dtype == torch.float16 for p in trainable),
        adapter=find_peft_model(pl_module) is not None,
        compiled=model.compiled,
        preallocating=any(isinstance(cb, CachePreallocator) for cb in trainer.callbacks),
        expandable_segments=expandable_segments_on(),
        streaming=getattr(dm, "streaming", False) is True,
        val_check_interval=getattr(trainer, "val_check_interval", None),
        validating=getattr(trainer, "limit_val_batches", 1) != 0,
    )


def _cuda_free_memory(device: torch.device) -> int | None:
    """Free bytes on a CUDA device, ``None`` for other devices (tests simulate a GPU by replacing this)."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


class ConfigChecks(Callback):
    """Warn once, at ``setup(stage="fit")``, about configurations known to waste memory or fail, with the fix.

    Checks (names for ``skip``): ``eval_batch_size`` differs from ``micro_batch_size``; ``batch_size`` given instead
    of ``micro_batch_size`` x ``accumulate_grad_batches``; ``fp16_packing``: fp16 weights (``16-true``) with packing
    and no flash attention; ``fp16_full_finetuning``: fp16 weights trained whole, not a (PEFT) adapter; ``fp8_compile``:
    Transformer Engine fp8 without ``torch.compile``; ``packing_attention``:
    packing with an attention implementation that cannot keep documents apart; ``flash_varlen``: packing with flash
    attention and several rows per batch, from a module that does not say it passes the varlen arguments
    (``passes_flash_varlen_kwargs = True``; ``CausalLM`` does); ``dynamic_shapes``: changing shapes on
    CUDA without ``CachePreallocator`` or expandable segments; ``memory``: on CUDA, the traced peak of the worst-case
    step (``memory/estimate.py``) exceeds the free device memory (the message names the micro_batch_size that fits);
    ``nonfinite_loss``: during training, the loss (``outputs["loss"]`` of ``training_step``) is NaN or infinite,
    warned once with the batch it happened at and the likely cause (fp16 full fine-tuning under ``16-true``); on
    an accelerator the losses are read every ``log_every_n_steps`` batches, not each step (no host sync per step).
    Facts are read defensively (``protocols.DescribesBatching`` for the batching, DataModule attributes or ``hparams``,
    ``pl_module.model.config._attn_implementation``), so any model and DataModule work; an unknown fact
    keeps its check quiet. The warnings found are in :attr:`problems`.

    Args:
        skip: names of checks to turn off.

    Raises:
        ValueError: if ``skip`` names an unknown check.

    Example::

        Trainer(callbacks=[ConfigChecks(skip=("eval_batch_size",))])
    """

    def __init__(self, skip: tuple[str, ...] | list[str] = ()) -> None:
        unknown = set(skip) - set(ALL_CHECKS)
        if unknown:
            raise ValueError(f"Unknown checks {sorted(unknown)} in skip; the checks are {list(ALL_CHECKS)}.")
        self.skip = tuple(skip)
        self.problems: dict[str, str] = {}
        self._warned: set[str] = set()
        self._loss_watch: LossWatch | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        found = find_problems(gather_facts(trainer, pl_module))
        found.update(self._memory_problem(trainer, pl_module) if "memory" not in self.skip else {})
        self.problems = {name: text for name, text in found.items() if name not in self.skip}
        for name, text in self.problems.items():
            if name not in self._warned:
                self._warned.add(name)
                rank_zero_warn(f"ConfigChecks [{name}]: {text}")

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if "nonfinite_loss" not in self.skip and "nonfinite_loss" not in self._warned:
            self._loss_watch = LossWatch(every_n_steps=getattr(trainer, "log_every_n_steps", 50) or 50)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: object, batch: object, batch_idx: int
    ) -> None:
        if self._loss_watch is not None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            self._warn_nonfinite(trainer, pl_module, self._loss_watch.add(loss, batch_idx, trainer.global_step))

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._loss_watch is not None:
            self._warn_nonfinite(trainer, pl_module, self._loss_watch.flush())

    def _warn_nonfinite(self, trainer: Trainer, pl_module: LightningModule, found: tuple | None) -> None:
        if found is None:
            return
        self._loss_watch = None  # once per run
        adapter = find_peft_model(pl_module) is not None
        text = nonfinite_loss_message(*found, precision=str(trainer.precision), adapter=adapter)
        self.problems["nonfinite_loss"] = text
        self._warned.add("nonfinite_loss")
        rank_zero_warn(f"ConfigChecks [nonfinite_loss]: {text}")

    @staticmethod
    def _memory_problem(trainer: Trainer, pl_module: LightningModule) -> dict[str, str]:
        """``memory``: on CUDA, the traced estimate of the worst-case step (the numbers ``seqmem-plan`` prints)
        against the device's free memory, before anything is allocated; names the micro_batch_size that fits."""
        from lightning_seqmem.memory.estimate import module_facts, shortfall_message

        dm, facts = trainer.datamodule, module_facts(pl_module)
        if facts is None or not isinstance(dm, GivesMaxBatchShape):
            return {}
        try:
            free = _cuda_free_memory(trainer.strategy.root_device)
            if free is None:
                return {}
            shape = tuple(int(x) for x in dm.max_batch_shape())
            keys = tuple(dm.batch_keys()) if isinstance(dm, GivesBatchKeys) else ("input_ids", "labels")
            message = shortfall_message(
                shape=shape, keys=keys, available=free, precision=str(trainer.precision), **facts
            )
        except Exception:  # an estimate we cannot make is no problem of the config
            return {}
        return {"memory": message} if message else {}
