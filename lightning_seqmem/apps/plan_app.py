"""``seqmem-plan``: the planner as a Hydra app over the same ``conf/`` as ``seqmem-train``.

``conf/plan.yaml`` composes ``config.yaml`` and adds a ``plan`` node, so ``seqmem-plan data=... model=... trainer=...``
reads the DataModule, model and Trainer settings of exactly the run ``seqmem-train`` with the same overrides would
launch. Only the DataModule is instantiated (for its tokenizer and settings); the model is traced on fake tensors.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from typing import Any

from lightning_seqmem.apps.train import CONFIG_PATH, choose_trainer

AUTO_PRECISION_WITHOUT_GPU = "bf16-mixed"  # what resolve_precision("auto") picks on any GPU made since 2020


def _precision(cfg) -> tuple[str, str]:
    """``(precision, note)`` of the run: ``plan.precision``, else ``trainer.precision`` (``auto`` resolved)."""
    from omegaconf import DictConfig

    value = cfg.plan.get("precision") or cfg.trainer.get("precision", "32-true")
    if isinstance(value, DictConfig):  # {_target_: resolve_precision, precision: auto}
        value = value.get("precision", "auto")
    if str(value) != "auto":
        return str(value), ""
    import torch

    if torch.cuda.is_available():
        from lightning_seqmem.memory.checks import resolve_precision

        return resolve_precision("auto"), ""
    return AUTO_PRECISION_WITHOUT_GPU, f"precision auto planned as {AUTO_PRECISION_WITHOUT_GPU} (no GPU here)"


def _devices(cfg) -> tuple[int, str]:
    value = cfg.plan.get("devices") or cfg.trainer.get("devices", 1)
    if isinstance(value, int) and value >= 1:
        return value, ""
    if isinstance(value, (list, tuple)) or hasattr(value, "__len__") and not isinstance(value, str):
        return len(value), ""
    import torch

    count = torch.cuda.device_count() if str(cfg.trainer.get("accelerator")) != "cpu" else 0
    if count:
        return count, ""
    return 1, f"trainer.devices={value} planned as 1 device; set plan.devices=N for N GPUs"


def _model_config(cfg, vocab_size: int, pad_token_id: int | None):
    from lightning_seqmem.training.building import build_model_config

    model = cfg.model
    if model.get("pretrained_path"):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model.pretrained_path, local_files_only=True)
    spec = model.get("model_config", "tiny_llama")
    if not isinstance(spec, str):
        from omegaconf import OmegaConf

        spec = OmegaConf.to_container(spec, resolve=True)
    return build_model_config(spec, model.get("vocab_size") or vocab_size, pad_token_id)


def plan_from_config(cfg, output_dir: str | None = None):
    """Build the :class:`~lightning_seqmem.apps.planner.RunPlan` for a composed ``plan.yaml`` config; returns
    ``(plan, notes)``."""
    from hydra.utils import instantiate

    from lightning_seqmem.apps.plan_lengths import stream_sample
    from lightning_seqmem.apps.plan_mix import mix_sample
    from lightning_seqmem.apps.plan_search import run_lora
    from lightning_seqmem.apps.planner import check_text, default_max_lengths, plan
    from lightning_seqmem.apps.train import datamodule_config
    from lightning_seqmem.mixing.spec import Mix

    p = cfg.plan
    dm, sampled = stream_sample(instantiate(datamodule_config(cfg.data)), p.get("stream_sample", 20_000))
    dm, mix_notes = mix_sample(dm)  # a Mix of one kind: planned on the documents its epoch reads
    mixed = isinstance(dm.dataset, Mix)  # still a Mix: of several kinds, each source planned by its own
    if not mixed:  # (a mix's sources are tokenized through the same cache, one by one, by the planner)
        dm.prepare_data()  # tokenize once (cached: the planner and the training run after it read the same tokens)
    max_length = dm.settings.batching.max_length
    max_lengths = list(p.max_lengths) if p.get("max_lengths") is not None else default_max_lengths(max_length)
    kind = None if mixed else dm.tokenized_documents()[1]
    if kind is not None and not kind.planned:  # draw what can be drawn, then refuse
        where = _pictures(None, dm, max_lengths, output_dir, p) if output_dir is not None else []
        check_text(kind, f" (its prompt and completion lengths are drawn in {where[0]})" if where else "")
    precision, note_precision = _precision(cfg)
    devices, note_devices = _devices(cfg)
    notes = [n for n in (note_precision, note_devices) if n] + mix_notes
    if sampled is not None:
        notes.append(
            f"a stream: planned on its first {sampled:,} training documents (plan.stream_sample); "
            "lengths, efficiency and memory carry over, document counts and steps per epoch are the sample's"
        )
    searches = p.get("memory", True) and p.get("gpu_memory") is not None  # the fit search follows the plan
    model_config, device = None, p.get("device") or ("cpu" if str(cfg.trainer.get("accelerator")) == "cpu" else "cuda")
    attention, optimizer = cfg.model.get("attn_implementation", "sdpa"), str(cfg.model.get("optimizer", "adamw"))
    if p.get("memory", True):
        vocab_size = cfg.model.get("vocab_size") or (len(dm.tokenizer) if dm.tokenizer is not None else None)
        if vocab_size is None:
            raise ValueError(
                "Pre-tokenized data without a tokenizer: give the model's vocabulary size "
                "(model.vocab_size=<n>), or plan without memory (plan.memory=false)."
            )
        model_config = _model_config(cfg, vocab_size, dm.pad_token_id)
        adapter = run_lora(cfg)
        trains = "full fine-tuning" if adapter is None else f"{'QLoRA' if adapter.quantize else 'LoRA'} r={adapter.r}"
        notes.append(
            f"memory for {getattr(model_config, 'model_type', '?')} on {device}, precision {precision}, "
            f"attention {attention}, {trains}, {'8-bit AdamW' if optimizer == 'adamw_8bit' else 'AdamW'}"
        )
    result = plan(
        dm,
        model_config,
        instantiate(p.strategies, _convert_="all"),  # batching objects (Pad, Truncate, Pack), as data.batching
        max_lengths,
        list(p.micro_batch_sizes),
        p.get("gpu_memory"),
        float(p.margin),
        precision,
        device,
        attention,
        devices,
        int(cfg.trainer.get("accumulate_grad_batches", 1)),
        reference_copy=_reference_copy(cfg),
        cross_entropy=cfg.model.get("cross_entropy", "auto"),
        lora=run_lora(cfg) if model_config is not None else None,
        optimizer=optimizer,
        shorter_advice=not searches,  # the fit search says what fits
    )
    pictures = _draw_aside(result, dm, max_lengths, output_dir, p, searches) if output_dir is not None else None
    if searches:  # the cheapest configuration that fits
        from lightning_seqmem.apps.plan_report import attach_fit
        from lightning_seqmem.apps.plan_search import search_run

        reference = _reference_copy(cfg)
        attach_fit(result, search_run(result, dm, model_config, cfg, precision, device, attention, devices, reference))
    if output_dir is not None:
        _write(result, output_dir)
        try:
            notes += [f"pictures: {', '.join(pictures())}"]
        except ImportError as error:
            notes.append(str(error))
    return result, notes


def _draw_aside(plan, dm, max_lengths, output_dir: str, p, aside: bool):
    """Start drawing the pictures (they need only ``plan``, not the fit search): in a forked child while this
    process searches when ``aside`` (about 2 s of matplotlib off the command's critical path on a second core),
    else here. Returns a function that gives the paths written, or raises the ``ImportError`` of a missing
    matplotlib; a child that fails otherwise is drawn again here, so a bug shows its own traceback."""
    if not aside or not hasattr(os, "fork"):
        try:
            paths = _pictures(plan, dm, max_lengths, output_dir, p)
        except ImportError as error:
            message = str(error)

            def missing() -> list[str]:
                raise ImportError(message)

            return missing
        return lambda: paths
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: draw, report, leave without running the parent's exit handlers
        os.close(read)
        try:
            out = {"paths": _pictures(plan, dm, max_lengths, output_dir, p)}
        except ImportError as error:
            out = {"missing": str(error)}
        except BaseException:
            out = {"failed": True}
        with os.fdopen(write, "w") as pipe:
            json.dump(out, pipe)
        os._exit(0)
    os.close(write)

    def wait() -> list[str]:
        with os.fdopen(read) as pipe:
            text = pipe.read()
        os.waitpid(pid, 0)
        out = json.loads(text) if text else {"failed": True}
        if "missing" in out:
            raise ImportError(out["missing"])
        return out["paths"] if "paths" in out else _pictures(plan, dm, max_lengths, output_dir, p)

    return wait


def _reference_copy(cfg) -> bool:
    """Whether the configured model keeps a frozen copy of its weights (``DPO`` with ``reference="copy"``)."""
    target = str(cfg.model.get("_target_", ""))
    return target.rsplit(".", 1)[-1] == "DPO" and cfg.model.get("reference", "copy") == "copy"


def _pictures(plan, dm, max_lengths, output_dir: str, p) -> list[str]:
    """Write the length histogram (one panel per part of the examples), the strategy chart and the memory chart
    named in ``plan.histogram``, ``plan.strategy_chart`` and ``plan.memory_chart`` (null: not drawn)."""
    from lightning_seqmem.apps import plots
    from lightning_seqmem.apps.plan_lengths import column_lengths

    os.makedirs(output_dir, exist_ok=True)
    pictures = []
    if p.get("histogram"):  # the plan's own train lengths; prompt/completion data (no plan) read per part
        parts = {"documents": plan.train_lengths} if plan is not None else column_lengths(dm)
        if plan is not None and plan.sources:  # a mix of several kinds: the mix's, then each source's own
            parts = {"mix": plan.train_lengths, **{s["name"]: s["lengths"] for s in plan.sources}}
        pictures.append((p.histogram, lambda: plots.length_histogram(parts, max_lengths)))
    if plan is not None and p.get("strategy_chart"):
        best = (plan.recommended["strategy"], plan.recommended["max_length"])
        pictures.append((p.strategy_chart, lambda: plots.strategy_bars(plan.strategies, best)))
    if plan is not None and plan.memory is not None and p.get("memory_chart"):
        pictures.append((p.memory_chart, lambda: plots.memory_bars(plan.memory)))
    return [plots.save(draw(), os.path.join(output_dir, name)) for name, draw in pictures]


def _write(plan, output_dir: str) -> None:
    os.makedirs(output_dir, exist_ok=True)
    record: dict[str, Any] = {
        "recommended": plan.recommended,
        "reason": plan.recommendation,
        "distribution": plan.distribution,
        "strategies": [asdict(s) for s in plan.strategies],
        "sources": [{k: v for k, v in s.items() if k != "lengths"} for s in plan.sources],
    }
    if plan.memory is not None:
        record["memory"] = {
            "length": plan.memory.length,
            "budget": plan.memory.budget,
            "margin": plan.memory.margin,
            "fits": {str(k): v for k, v in plan.memory.fits.items()},
            "advice": plan.memory.advice,
            "estimates": [e.as_dict() for by_rows in plan.memory.estimates.values() for e in by_rows.values()],
        }
    with open(os.path.join(output_dir, "plan.json"), "w") as f:
        json.dump(record, f, indent=2, default=str)


def _hydra_entry() -> None:
    import hydra

    @hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="plan")
    def _main(cfg) -> None:
        from hydra.core.hydra_config import HydraConfig

        from lightning_seqmem.apps.overrides import job_started

        job_started()

        from lightning_seqmem.apps.console import (
            log_each_line_once,
            no_bars_unless_a_terminal,
            quiet_upstream_noise,
        )
        from lightning_seqmem.apps.planner import format_plan
        from lightning_seqmem.apps.short_process import resume_gc

        quiet_upstream_noise()
        no_bars_unless_a_terminal()
        log_each_line_once()  # after Hydra has set up the job's logging, as seqmem-train: each log line once
        from lightning_seqmem.apps.errors import for_hydra

        resume_gc()  # everything imported (main paused the collector): it runs again for the data and the traces

        try:
            plan, notes = plan_from_config(cfg, HydraConfig.get().runtime.output_dir)
        except Exception as err:
            reported = for_hydra(err, cfg, "data")  # a user's mistake: its message alone, data.<key> (errors.py)
            if reported is err:
                raise
            raise reported from err
        print(format_plan(plan))
        for note in notes:
            print(f"Note: {note}")

    _main()


def main() -> None:
    """Console-script entry point (``seqmem-plan``): run as a process of its own, it pauses the cyclic collector
    while it imports and leaves without the interpreter's teardown (``short_process``: about 3 CPU-seconds)."""
    from lightning_seqmem.apps.short_process import leave_now, pause_gc, resume_gc

    pause_gc(main)  # until the packages are imported (the Hydra task below)
    try:
        sys.argv[1:] = choose_trainer(sys.argv[1:], doing="planning for")
        from lightning_seqmem.apps.overrides import overrides_checked

        with overrides_checked(sys.argv[1:], "plan"):  # "did you mean", not Hydra's advice to add the key with +
            _hydra_entry()
    finally:
        resume_gc()
    leave_now(main)


if __name__ == "__main__":
    sys.exit(main())
