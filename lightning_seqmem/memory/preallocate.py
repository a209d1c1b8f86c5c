"""Cache pre-allocation: run the largest batch of the run once, before training, and keep its memory reserved.

A run whose worst-case batch does not fit then fails in its first minute with a message that says why and what to
change, not at hour five when the longest batch finally comes up; and a run that fits reserves its peak up front,
so later (smaller) batches are carved out of one set of cached blocks instead of fragmenting memory.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_seqmem.batch import PAD_KEYS, Layout, default_layout
from lightning_seqmem.memory import stats
from lightning_seqmem.memory.model_facts import model_facts
from lightning_seqmem.memory.optimizer_state import (
    gradient_standins,
    state_standins,
    step_temporaries,
    trained_parameters,
)
from lightning_seqmem.memory.preallocation_report import PreallocationOOMError, PreallocationReport
from lightning_seqmem.memory.untouched import untouched
from lightning_seqmem.memory.worst_batch import check_layout, make_dummy_batch
from lightning_seqmem.messages import short_repr
from lightning_seqmem.oom.hooks import pause_splitting
from lightning_seqmem.protocols import (
    GivesBatchKeys,
    GivesMaxBatchShape,
    GivesWarmupShape,
    GivesWorstBatchLayout,
    find_pad_token_id,
)

__all__ = ["CachePreallocator", "PreallocationOOMError", "PreallocationReport"]


# CUDA queries live in small functions so tests can simulate a GPU on CPU.
def _cuda_reset_peak(device: torch.device) -> None:
    torch.cuda.reset_peak_memory_stats(device)


def _cuda_peak_allocated(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device)


def _cuda_allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device)


def _cuda_reserved(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device)


def _cuda_mem_get_info(device: torch.device) -> tuple[int, int]:
    torch.cuda.empty_cache()  # count the blocks the failed pass left cached as available
    return torch.cuda.mem_get_info(device)


def _is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _loss(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return output.get("loss")
    return None


class CachePreallocator(Callback):
    """Run the run's costliest training step once before training starts, leaving its memory reserved.

    In ``on_fit_start`` a synthetic batch (random token ids) of the worst-case shape goes through the
    LightningModule's own ``training_step`` (said once in the log, since a user's step meets a batch it did not load)
    under the Trainer's precision context (autocast), then ``backward``, with what a steady-state step also holds:
    the optimizer state its first step will make, the previous step's gradients during the forward, and the
    optimizer step's temporaries (:mod:`~lightning_seqmem.memory.optimizer_state`: plain tensors of the same
    sizes, dropped afterwards; Adam, AdamW and SGD are known). Then every gradient is set to ``None``. Nothing else
    changes: no optimizer or scheduler step, and parameters, optimizer state, buffers, torchmetrics states, scalar
    attributes of the LightningModule (counters) and its ``TokenLossNormalizer`` objects, ``global_step`` and the
    python, numpy, torch and CUDA RNGs are as before. ``self.log`` calls inside ``training_step`` are no-ops for
    this pass. A shape the model cannot take (longer than its position embeddings, say) fails here too, in the
    first minute.

    The shape comes from ``trainer.datamodule.max_batch_shape()`` (keys from ``batch_keys()``; the
    :mod:`~lightning_seqmem.protocols` ``GivesMaxBatchShape`` and ``GivesBatchKeys``), or from ``rows`` and ``length``.
    A callback with ``max_warmup_shape(rows, length)`` (``GivesWarmupShape``; ``SeqLengthWarmup``: reshape mode makes
    more rows of fewer tokens, truncation shorter rows) reshapes those batches, so its answer replaces the
    DataModule's shape. What the batch holds follows the real batches (padding inside a row, several packed
    documents per row: transformers builds a 4-D attention mask for those, not for one unpadded document):
    ``trainer.datamodule.worst_batch_layout(rows, length)`` (``GivesWorstBatchLayout``), else the costliest layout
    the keys allow (:func:`~lightning_seqmem.memory.worst_batch.default_layout`).

    Lightning calls ``torch.cuda.empty_cache()`` after ``on_fit_start`` (``CheckpointConnector.resume_end``), which
    hands the cached blocks back to the driver. So on CUDA the pass runs again in ``on_train_start`` (after the
    sanity check; nothing empties the cache between that hook and the first batch) whenever the reserved memory has
    dropped below what the first pass left. On CPU the pass is a shape check and records the process's peak RSS.

    Under DDP the pass calls the unwrapped LightningModule on every rank: no gradient all-reduce (DDP's reducer
    ignores a backward it did not prepare in ``forward``), so ranks stay in step and DDP's own counters are
    untouched; its gradient buckets already exist. Under FSDP it runs through the strategy's wrapped module (every
    rank at once: FSDP gathers the shards in forward and reduce-scatters the gradients in backward), with the
    optimizer state of this rank's shards. Collectives inside your ``training_step`` run on every rank. Skipped
    with a warning for manual optimization (its ``training_step`` steps the optimizer) and DeepSpeed.

    Args:
        rows: rows of the worst-case micro-batch; with ``length``, overrides the DataModule.
        length: tokens per row of the worst-case micro-batch.
        keys: batch keys; default the DataModule's ``batch_keys()``, else ``input_ids``, ``attention_mask``, ``labels``.
        vocab_size: token ids are drawn below it; default the module's (``model_facts``: ``pl_module.model.config``,
            hparams or attribute; else zeros).
        rereserve: on CUDA, run again in ``on_train_start`` when ``empty_cache`` released the reservation.

    Raises:
        ValueError: if only one of ``rows``/``length`` is given, or a value is not a positive int.
        MisconfigurationException: at setup, when there is neither ``rows``/``length`` nor a DataModule with
            ``max_batch_shape()``.
        PreallocationOOMError: when the worst-case batch does not fit (shape, memory needed vs available, fixes).

    Example::

        trainer = Trainer(callbacks=[CachePreallocator()])
        trainer.fit(CausalLM(), datamodule=SeqMemDataModule(max_length=2048, micro_batch_size=8))
    """

    def __init__(
        self,
        rows: int | None = None,
        length: int | None = None,
        keys: Sequence[str] | None = None,
        vocab_size: int | None = None,
        rereserve: bool = True,
    ) -> None:
        if (rows is None) != (length is None):
            raise ValueError(
                "Give both rows and length (the worst-case micro-batch), or neither to ask the DataModule."
            )
        for name, value in (("rows", rows), ("length", length), ("vocab_size", vocab_size)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {short_repr(value)}.")
        if keys is not None and (isinstance(keys, str) or not all(isinstance(k, str) for k in keys)):
            raise TypeError(f"keys must be a sequence of str such as ('input_ids', 'labels'), got {short_repr(keys)}.")
        self.rows = rows
        self.length = length
        self.keys = tuple(keys) if keys is not None else None
        self.vocab_size = vocab_size
        self.rereserve = rereserve
        self.report: PreallocationReport | None = None
        self._skip_reason: str | None = None
        self._predicted: str | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.rows is None and not isinstance(trainer.datamodule, GivesMaxBatchShape):
            raise MisconfigurationException(
                "CachePreallocator needs the worst-case batch shape: pass a DataModule with max_batch_shape() "
                "(e.g. SeqMemDataModule), or CachePreallocator(rows=..., length=...)."
            )
        self._skip_reason = None
        if not pl_module.automatic_optimization:
            self._skip_reason = "manual optimization (its training_step would step the optimizer)"
        strategy = type(trainer.strategy).__name__
        if "DeepSpeed" in strategy:
            self._skip_reason = f"{strategy} partitions and steps the model its own way"
        if self._skip_reason:
            rank_zero_warn(f"CachePreallocator is skipped: {self._skip_reason}.")

    def worst_case_shapes(self, trainer: Trainer) -> list[tuple[int, int]]:
        """The ``(rows, length)`` shapes to pre-allocate for, most tokens first."""
        if self.rows is not None:
            base = (self.rows, self.length)
        else:
            base = tuple(int(x) for x in trainer.datamodule.max_batch_shape())
        # A callback that reshapes batches (SeqLengthWarmup) knows the run's worst case, full length included.
        shapes = [
            tuple(int(x) for x in cb.max_warmup_shape(*base))
            for cb in trainer.callbacks
            if cb is not self and isinstance(cb, GivesWarmupShape)
        ] or [base]
        # A shape no larger in both rows and length than another needs no pass of its own.
        shapes = list(
            dict.fromkeys(s for s in shapes if not any(o != s and o[0] >= s[0] and o[1] >= s[1] for o in shapes))
        )
        return sorted(shapes, key=lambda s: (s[0] * s[1], s[1]), reverse=True)

    def _batch_keys(self, trainer: Trainer) -> tuple[str, ...]:
        if self.keys is not None:
            return self.keys
        if isinstance(trainer.datamodule, GivesBatchKeys):
            return tuple(trainer.datamodule.batch_keys())
        return PAD_KEYS  # a padded batch: what a loader that is not ours most likely yields

    def worst_case_layout(self, trainer: Trainer, shape: tuple[int, int]) -> Layout:
        """Document lengths per row of the ``shape`` batch: the DataModule's answer, else the keys' costliest."""
        if isinstance(trainer.datamodule, GivesWorstBatchLayout):
            return check_layout(trainer.datamodule.worst_batch_layout(*shape), *shape)
        return default_layout(*shape, self._batch_keys(trainer))

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._skip_reason:
            return
        shapes = self.worst_case_shapes(trainer)
        self.report = PreallocationReport(
            shapes=shapes,
            keys=self._batch_keys(trainer),
            device=str(pl_module.device),
            layouts=[self.worst_case_layout(trainer, s) for s in shapes],
        )
        self._predicted = self._predicted_shortfall(trainer, pl_module)
        if self._predicted:
            rank_zero_warn(f"CachePreallocator: {self._predicted}")
        rank_zero_info(
            f"CachePreallocator: {type(pl_module).__name__}.training_step(batch, 0) and backward run once on a "
            f"synthetic batch ({', '.join(f'{r}x{n}' for r, n in shapes)}, random token ids) before training; "
            "the module's state is put back, other side effects of the step (lists, files, loggers) see that batch."
        )
        self._run(trainer, pl_module, "fit_start")
        rank_zero_info(self.report.summary())

    def _predicted_shortfall(self, trainer: Trainer, pl_module: LightningModule) -> str | None:
        """CUDA, before the pass allocates anything: the traced estimate of the worst-case step
        (``memory/estimate.py``, the numbers ``seqmem-plan`` prints) when it exceeds the free memory, with the
        micro_batch_size that fits (under FSDP weights, gradients and optimizer state count once per shard).
        Warned, and repeated if the pass then runs out of memory."""
        from lightning_seqmem.memory.estimate import module_facts, shortfall_message

        facts = module_facts(pl_module)
        if facts is None or not _is_cuda(pl_module.device):
            return None
        try:
            free, _ = _cuda_mem_get_info(pl_module.device)
            available = free + _cuda_allocated(pl_module.device)  # weights already there are part of the estimate
            return shortfall_message(
                shape=self.report.shapes[0],
                keys=self.report.keys,
                available=available,
                precision=str(trainer.precision),
                shards=_shards(trainer),
                **facts,
            )
        except Exception as error:  # an estimate we cannot make must never stop the run
            rank_zero_info(f"CachePreallocator: no memory estimate ({type(error).__name__}: {str(error)[:200]}).")
            return None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.report is None or not self.rereserve or not _is_cuda(pl_module.device):
            return
        if _cuda_reserved(pl_module.device) < (self.report.reserved or 0):
            self._run(trainer, pl_module, "train_start")

    def _run(self, trainer: Trainer, pl_module: LightningModule, phase: str) -> None:
        report = self.report
        device = pl_module.device
        on_cuda = _is_cuda(device)
        vocab_size = self.vocab_size or model_facts(pl_module).vocab_size
        pad = find_pad_token_id(trainer.datamodule, pl_module, pl_module.hparams) or 0
        wrapper = trainer.strategy.model if _through_wrapper(trainer) else None
        optimizers = list(trainer.optimizers)
        params = trained_parameters(optimizers) or [p for p in pl_module.parameters() if p.requires_grad]
        start = time.perf_counter()
        if on_cuda:
            _cuda_reset_peak(device)
        else:
            import psutil

            report.rss_before = psutil.Process().memory_info().rss
        failure: tuple[tuple[int, int], str] | None = None
        with untouched(pl_module, wrapper), torch.profiler.record_function("CachePreallocator"):
            state = [state_standins(optimizer) for optimizer in optimizers]  # held for the whole pass
            report.optimizer_state = (
                None if any(s is None for s in state) else sum(t.numel() * t.element_size() for s in state for t in s)
            )
            for shape, layout in zip(report.shapes, report.layouts):
                batch = make_dummy_batch(*shape, report.keys, vocab_size, device, layout=layout, pad_token_id=pad)
                try:
                    self._step(trainer, pl_module, batch, params, optimizers, wrapper)
                except torch.OutOfMemoryError as error:  # leave the except block first so the activations are freed
                    failure = (shape, str(error))
                    break
            del state
        if failure is not None:
            raise PreallocationOOMError(self._oom_message(device, *failure)) from None
        report.seconds = time.perf_counter() - start
        report.passes.append(phase)
        if on_cuda:
            report.peak_allocated = _cuda_peak_allocated(device)
            report.reserved = _cuda_reserved(device)
        else:
            report.peak_rss = stats.peak_rss_bytes()

    @staticmethod
    def _step(
        trainer: Trainer,
        pl_module: LightningModule,
        batch: dict[str, torch.Tensor],
        params: list[torch.Tensor],
        optimizers: list[torch.optim.Optimizer],
        wrapper: torch.nn.Module | None,
    ) -> None:
        """One step in the order of Lightning's automatic optimization: forward with the previous step's gradients
        alive, zero_grad (not under gradient accumulation), backward, the optimizer step's temporaries."""
        grads = gradient_standins(params)
        batch = trainer.precision_plugin.convert_input(batch)
        if wrapper is not None:  # FSDP: through the wrapped module (gathers shards, reduce-scatters gradients)
            with pause_splitting(pl_module):  # on_oom="split" paused, as below: Lightning's step
                loss = _loss(trainer.strategy.training_step(batch, 0))
        else:  # on_oom="split" paused: this pass must meet the error it reports, and runs its own backward
            with trainer.precision_plugin.train_step_context(), pause_splitting(pl_module):
                loss = _loss(pl_module.training_step(batch, 0))
        if trainer.accumulate_grad_batches == 1:
            del grads[:]  # Lightning zeroes gradients after the forward, before backward
        if loss is not None:
            loss.backward()  # unscaled: the scale does not change memory, and the gradients are thrown away
        del loss
        temporaries = [step_temporaries(optimizer) for optimizer in optimizers]
        del temporaries, grads
        for module in (pl_module, wrapper):
            if module is not None:  # the next shape's forward sees only the stand-ins
                module.zero_grad(set_to_none=True)

    def _oom_message(self, device: torch.device, shape: tuple[int, int], cause: str) -> str:
        tried = stats.parse_tried_to_allocate(cause)
        if _is_cuda(device):
            held = _cuda_allocated(device)  # weights, optimizer state: what stays when the pass is gone
            extra = _cuda_peak_allocated(device) - held
            needed = extra + tried if tried is not None else extra
            free, total = _cuda_mem_get_info(device)
        else:
            import psutil

            memory = psutil.virtual_memory()
            held, needed, free, total = None, tried, memory.available, memory.total
        message = stats.oom_message(shape, self.report.keys, str(device), needed, free, total, held, cause)
        return message + (f"\nEstimate: {self._predicted}" if self._predicted else "")


def _through_wrapper(trainer: Trainer) -> bool:
    """FSDP shards the parameters: only its wrapped module can run a step."""
    from lightning.pytorch.strategies import FSDPStrategy

    return isinstance(trainer.strategy, FSDPStrategy)


def _shards(trainer: Trainer) -> int:
    """How many ranks share weights, gradients and optimizer state (FSDP), else 1."""
    return int(trainer.world_size) if _through_wrapper(trainer) else 1
