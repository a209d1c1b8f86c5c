"""Run summary: what the padding strategy cost, in one table at the end of ``fit``.

Strategy, real-token fraction of the slots fed to the model, tokens lost to truncation, real tokens per second,
peak memory and final validation loss: the figures that tell whether padding, truncation or packing paid off.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from lightning_seqmem.apps.mix_report import source_rows
from lightning_seqmem.apps.run_files import SUMMARY_FILE
from lightning_seqmem.memory.stats import peak_rss_bytes
from lightning_seqmem.protocols import CountsTrainingTokens, DescribesBatching, GivesDataStats, SurvivesOom

# What a run carries through its checkpoints: real tokens and slots (all ranks), training and wall-clock seconds,
# and the step they were counted to.
_NOTHING_BEFORE: dict[str, Any] = {"real": 0, "slots": 0, "train_s": 0.0, "wall_s": 0.0, "step": 0}


def peak_memory_bytes(device: torch.device | None = None) -> tuple[int, str]:
    """Peak memory so far: CUDA max allocated on a GPU, else the process's peak resident set size."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda max allocated"
    return peak_rss_bytes(), "peak RSS"


def format_table(rows: dict[str, Any]) -> str:
    """A two-column text table."""
    width = max(len(k) for k in rows)
    lines = [f"{'metric':<{width}}  value", f"{'-' * width}  {'-' * 24}"]
    for key, value in rows.items():
        if isinstance(value, float):
            value = f"{value:,.4f}" if abs(value) < 100 else f"{value:,.0f}"
        elif isinstance(value, int):
            value = f"{value:,}"
        lines.append(f"{key:<{width}}  {value}")
    return "\n".join(lines)


class RunSummary(Callback):
    """Print (and save as JSON) a summary of the run at the end of ``fit``.

    Asks the LightningModule for its token counters (``protocols.CountsTrainingTokens``: ``CausalLM``) and the
    DataModule for its batching (``DescribesBatching``) and ``stats()`` (``GivesDataStats``); what a component does
    not answer is left out rather than guessed.

    Args:
        path: where to write the summary as JSON; default ``<trainer.default_root_dir>/summary.json``.
        print_table: print the table on rank 0.

    Example::

        trainer = Trainer(callbacks=[RunSummary()])
    """

    def __init__(self, path: str | None = None, print_table: bool = True) -> None:
        self.path = path
        self.print_table = print_table
        self.summary: dict[str, Any] = {}
        self._start = 0.0
        self._before: dict[str, Any] = dict(_NOTHING_BEFORE)  # the run's figures up to the checkpoint resumed
        self._trainer: Trainer | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = time.perf_counter()

    def _this_process(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, float]:
        """Real tokens and slots trained on since this process started (summed over ranks: every rank calls it),
        its training seconds (rank 0's) and wall-clock."""
        if not isinstance(pl_module, CountsTrainingTokens):
            return {"real": 0, "slots": 0, "train_s": 0.0, "wall_s": time.perf_counter() - self._start}
        both = torch.tensor([float(pl_module.real_tokens_seen), float(pl_module.slots_seen)])
        both = trainer.strategy.reduce(both.to(pl_module.device), reduce_op="sum").cpu()
        train_s = pl_module.train_seconds
        return {
            "real": int(both[0]),
            "slots": int(both[1]),
            "train_s": train_s,
            "wall_s": time.perf_counter() - self._start,
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        """The whole run's counts at the checkpoint (a resumed run reports the whole run, not its own part)."""
        trainer = self._trainer
        if trainer is None or trainer.lightning_module is None:
            return dict(self._before)
        now = self._this_process(trainer, trainer.lightning_module)
        return {k: self._before[k] + now[k] for k in ("real", "slots", "train_s", "wall_s")} | {
            "step": trainer.global_step
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._before = {k: state_dict.get(k, v) for k, v in _NOTHING_BEFORE.items()}

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        now = self._this_process(trainer, pl_module)
        before, resumed = self._before, self._before["step"] > 0
        dm = trainer.datamodule
        summary: dict[str, Any] = {}
        if isinstance(dm, DescribesBatching):
            summary["strategy"] = dm.batching_label()
        if dm is not None and hasattr(dm, "max_length"):
            summary["max_length"] = dm.max_length
        counts = isinstance(pl_module, CountsTrainingTokens)
        real, slots = before["real"] + now["real"], before["slots"] + now["slots"]
        if counts:  # the whole run's (the figures saved in the checkpoint resumed, and this process's)
            summary["real_tokens_trained"] = real
            summary["slots_fed_to_model"] = slots
            summary["real_token_fraction"] = real / max(slots, 1)
        stats = dm.stats() if isinstance(dm, GivesDataStats) else {}
        train_stats = stats.get("train", stats) if isinstance(stats, dict) else {}
        for key in ("tokens_truncated", "tokens_dropped", "documents_split", "empty_documents_skipped"):
            if key in train_stats:
                summary[f"dataset_{key}"] = train_stats[key]
        for name, source in train_stats.get("sources", {}).items():  # a Mix: what the run read of each source
            for key, value in source_rows(source, real if counts else None).items():
                summary[f"source_{name}_{key}"] = value
        summary["optimizer_steps"] = trainer.global_step
        summary["wall_clock_s"] = before["wall_s"] + now["wall_s"]
        if counts:
            train_s = before["train_s"] + now["train_s"]
            summary["real_tokens_per_s"] = real / max(train_s or summary["wall_clock_s"], 1e-9)
        if resumed:  # what this process did alone
            summary["resumed_at_step"] = before["step"]
            summary["optimizer_steps_since_resume"] = trainer.global_step - before["step"]
            if counts:
                summary["real_tokens_trained_since_resume"] = now["real"]
            summary["wall_clock_s_since_resume"] = now["wall_s"]
        if isinstance(pl_module, SurvivesOom):  # on_oom="split": out-of-memory micro-batches survived, all ranks
            splits = trainer.strategy.reduce(
                torch.tensor(float(pl_module.oom_splits), device=trainer.strategy.root_device), reduce_op="sum"
            )
            if splits > 0:
                summary["oom_splits"] = int(splits)
                summary["oom_split_tokens"] = pl_module.oom_split_tokens
        peak, what = peak_memory_bytes(pl_module.device)
        summary[f"peak_memory_mib ({what})"] = peak / 2**20
        sources = sorted(k for k in trainer.callback_metrics if k.startswith("val/loss/"))  # a Mix: val/loss/<name>
        for key in ("val/loss", *sources, "train/loss"):
            value = trainer.callback_metrics.get(key)
            if value is not None:
                summary[f"final_{key.replace('/', '_')}"] = float(value)
        self.summary = summary
        self._write(trainer)

    @rank_zero_only
    def _write(self, trainer: Trainer) -> None:
        path = self.path or os.path.join(trainer.default_root_dir, SUMMARY_FILE)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.summary, f, indent=2)
        if self.print_table:
            print("\n" + format_table(self.summary) + "\n", flush=True)
