"""``seqmem-train``: the main job, a Hydra app over ``conf/`` (shipped in the wheel as ``lightning_seqmem.conf``).

Builds the DataModule, the model, the callbacks, the loggers and the Trainer from the config with
``hydra.utils.instantiate``, in that order, and fits. The CUDA allocator is configured before torch is imported;
each log line is printed once and upstream deprecation noise is silenced (``console``), in this process only.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from lightning_seqmem.apps.run_files import FAILED, FINISHED, INTERRUPTED, JOB_STATUS_FILE, RUNNING, SUMMARY_FILE
from lightning_seqmem.memory.allocator import configure_allocator

CONFIG_PATH = "pkg://lightning_seqmem.conf"
log = logging.getLogger(__name__)


def choose_trainer(overrides: list[str], doing: str = "training with") -> list[str]:
    """``trainer=auto`` (the default) made concrete for this machine: ``trainer=gpu`` where CUDA GPUs are visible,
    announced in one line; the overrides as given otherwise (``auto`` is ``cpu``'s settings). Runs before Hydra
    composes, so the job's ``.hydra/overrides.yaml`` records the option that ran. ``seqmem-plan`` makes the same
    choice (``doing="planning for"``), so it plans the run ``seqmem-train`` launches.

    Example::

        choose_trainer(["batching=pad"])  # ["batching=pad", "trainer=gpu"] on a GPU machine, as given on a CPU
    """
    given = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") == "trainer"]
    if given and given[-1] != "trainer=auto":
        return overrides
    from lightning.fabric.accelerators.cuda import num_cuda_devices

    count = num_cuda_devices()
    if count == 0:
        return overrides
    print(
        f"[lightning_seqmem] {count} CUDA GPU{'s' if count > 1 else ''} visible: {doing} trainer=gpu (one GPU, "
        "precision from resolve_precision('auto')). trainer=cpu keeps the CPU; trainer=ddp uses every GPU.",
        file=sys.stderr,
    )
    return [o for o in overrides if o not in given] + ["trainer=gpu"]


def _is_rank_zero() -> bool:
    # The job's rank zero under Lightning's launcher, torchrun and srun alike (apps/cluster.py).
    from lightning_seqmem.apps.cluster import is_rank_zero

    return is_rank_zero()


def _instantiate_all(group: Any) -> list[Any]:
    """Instantiate every entry of a ``{name: {_target_: ...}}`` config group, skipping disabled (null) ones."""
    from hydra.utils import instantiate

    objects = []
    for name, node in (group or {}).items():
        if node is None:
            continue
        if "_target_" not in node:
            raise ValueError(f"Config entry {name!r} has no _target_; give it one or remove it with ~{name}.")
        objects.append(instantiate(node))
    return objects


def _check_required(cfg) -> None:
    """Values that a group option leaves to the user (``dataset: null`` in ``data=local``/``data=hf``).

    Raises:
        ValueError: ``data.dataset`` is null; the message says which ``data=`` option needs it and how to give it.
    """
    data = cfg.get("data")
    if data is None or "dataset" not in data or data.dataset is not None:
        return
    from hydra.core.hydra_config import HydraConfig

    choice = HydraConfig.get().runtime.choices.get("data") if HydraConfig.initialized() else None
    example = "roneneldan/TinyStories" if choice == "hf" else "'data/*.jsonl'"
    raise ValueError(
        f"data.dataset is required{f' with data={choice}' if choice else ''}: say what to train on, e.g. "
        f"seqmem-train data={choice or 'local'} data.dataset={example} (a file, glob or directory; data=hf: a "
        "hub name). data=builtin trains on the built-in corpus."
    )


MIX_KEYS = ("sources", "weights", "by", "exhausted")  # data=mix: they feed data.dataset (a Mix), not the DataModule


def datamodule_config(data: Any) -> Any:
    """``data`` without the keys of ``data=mix`` that only its ``dataset`` (a ``Mix``) reads by interpolation, so
    ``data.weights.chat=0.5`` overrides a weight and the DataModule gets what it takes."""
    if data is None or not any(k in data for k in MIX_KEYS):
        return data
    from omegaconf import OmegaConf

    resolved = OmegaConf.to_container(data, resolve=True)
    return {k: v for k, v in resolved.items() if k not in MIX_KEYS}


DATAMODULE_TRAINER_KEYS = ("prepare_data_per_node",)  # trainer.* keys that the DataModule takes, not the Trainer


def trainer_config(cfg: Any) -> Any:
    """``cfg.trainer`` without the keys the DataModule takes (``prepare_data_per_node``), cut from a copy of the
    whole config so that the trainer's interpolations still resolve."""
    if not any(key in cfg.trainer for key in DATAMODULE_TRAINER_KEYS):
        return cfg.trainer
    import copy

    from omegaconf import open_dict

    whole = copy.deepcopy(cfg)
    with open_dict(whole.trainer):
        for key in DATAMODULE_TRAINER_KEYS:
            whole.trainer.pop(key, None)
    return whole.trainer


def build_datamodule(cfg: Any) -> Any:
    """The DataModule of ``data``, with Lightning's ``prepare_data_per_node`` (a DataModule attribute) from
    ``trainer.prepare_data_per_node``: each node's first process prepares the data, or the job's rank zero once."""
    from hydra.utils import instantiate

    datamodule = instantiate(datamodule_config(cfg.data))
    per_node = cfg.trainer.get("prepare_data_per_node")
    if per_node is not None:
        datamodule.prepare_data_per_node = bool(per_node)
    return datamodule


def _progress_bar_allowed(callback: Any, trainer_cfg: Any) -> bool:
    """Whether the app keeps a configured callback: not a progress bar under ``enable_progress_bar=False`` (Lightning
    refuses the pair; that switch wins), nor the sequence-length warmup at ``duration=0`` (present so that a sweep
    can vary it, off: it would change nothing, and its checks would warn about batches it never cuts)."""
    from lightning.pytorch.callbacks import ProgressBar

    from lightning_seqmem.warmup import SeqLengthWarmup

    if isinstance(callback, SeqLengthWarmup) and callback.duration == 0:
        return False
    return not (isinstance(callback, ProgressBar) and trainer_cfg.get("enable_progress_bar") is False)


def check_data(datamodule: Any, cfg) -> None:
    """Read the data before the model and the Trainer are built, so that a missing file or column, or a row the
    kind refuses, stops the job in seconds, its message in the Hydra spelling (``data.text_column=...``).

    On rank zero only (the other ranks of a DDP job start after it, and Lightning's ``prepare_data`` runs once per
    node); ``setup("fit")`` too when the job is one process (under DDP each rank sets up after the Trainer knows
    its rank). A ``ddp_spawn`` job leaves it all to the Trainer, whose children receive the DataModule pickled.
    Lightning's own calls find the work done (``prepare_data`` and ``setup`` keep what they read).
    """
    trainer = cfg.trainer
    strategy = str(trainer.get("strategy", "auto"))
    if not _is_rank_zero() or "spawn" in strategy or not hasattr(datamodule, "prepare_data"):
        return
    from lightning_seqmem.apps.errors import for_hydra

    try:
        datamodule.prepare_data()
        alone = trainer.get("devices", 1) in (1, "1") and trainer.get("num_nodes", 1) in (1, "1")
        if alone and strategy in ("auto", "None", "single_device"):
            datamodule.setup("fit")
    except Exception as err:
        reported = for_hydra(err, cfg, "data")  # a user's mistake, spelt data.<key>=...
        if reported is err:
            raise
        raise reported from err


def _resume(cfg) -> tuple[str | None, Any]:
    """The checkpoint ``ckpt_path=`` names (``resolve_ckpt_path``) and the checkpoint interval to keep: the one
    given, else the checkpoint's own (a resumed run that saved nothing would lose all it trains at the next stop).
    Says in one line where the run resumes from, and warns when ``max_steps`` is not the checkpoint's."""
    from lightning_seqmem.apps.checkpoints import describe, resolve_ckpt_path

    path, note = resolve_ckpt_path(cfg.get("ckpt_path"), cfg.trainer.default_root_dir)
    every = cfg.get("checkpoint_every_n_steps")
    if note and _is_rank_zero():
        log.info(note)
    if path is None:
        return None, every
    info = describe(path)
    kept = every is None and info["every_n_train_steps"]
    every = info["every_n_train_steps"] if kept else every
    if _is_rank_zero():
        data = f", {info['data']}" if info["data"] else ""
        saving = f"; checkpoints every {every} steps as before (checkpoint_every_n_steps=0: none)" if kept else ""
        log.info(f"resuming from {path}: step {info['step']}, epoch {info['epoch']}{data}{saving}")
        planned, given = info["max_steps"], cfg.trainer.get("max_steps")
        if planned is not None and given is not None and planned != given:
            log.warning(
                f"trainer.max_steps={given} is not the checkpoint's ({planned}): the learning-rate schedule is "
                f"planned over max_steps, so the resumed steps follow another schedule than the first run's; "
                f"trainer.max_steps={planned} keeps it."
            )
    return path, every


def _bar_and_summary(cfg, callbacks: list[Any]) -> dict[str, Any]:
    """Trainer switches left to the app: a step bar where no callback shows progress (Lightning's own bar counts
    epochs, ``Epoch 0/-2`` for a run bounded by steps) and no model-summary table into a pipe or a file."""
    from lightning.pytorch.callbacks import ProgressBar

    from lightning_seqmem.training.progress import StepProgressBar

    extra: dict[str, Any] = {}
    if cfg.trainer.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
        callbacks.append(StepProgressBar())
    if cfg.trainer.get("enable_model_summary") is None and not sys.stdout.isatty():
        extra["enable_model_summary"] = False
    return extra


def train(cfg) -> dict[str, Any]:
    """Fit with the composed config; returns the run summary (final validation loss included)."""
    import lightning.pytorch as L
    from hydra.utils import instantiate

    from lightning_seqmem.apps.checkpoints import CHECKPOINT_DIR, RunCheckpoint
    from lightning_seqmem.apps.short_process import resume_gc
    from lightning_seqmem.apps.summary import RunSummary

    resume_gc()  # Lightning imported (main paused the collector): it runs again for the data, the model, the fit
    _check_required(cfg)
    ckpt_path, every = _resume(cfg)
    L.seed_everything(cfg.seed, workers=True)
    datamodule = build_datamodule(cfg)
    check_data(datamodule, cfg)
    if _is_rank_zero():
        from lightning_seqmem.apps.mix_report import start_line

        shares = start_line(datamodule)  # a Mix: each source's share of the run, and what truncation costs it
        if shares:
            log.info(shares)
    model = instantiate(cfg.model)
    callbacks = [cb for cb in _instantiate_all(cfg.get("callbacks")) if _progress_bar_allowed(cb, cfg.trainer)]
    loggers = _instantiate_all(cfg.get("logger"))
    extra = _bar_and_summary(cfg, callbacks)
    if every:  # a long run keeps its place: the weights, the optimizer and the data's position
        folder = os.path.join(cfg.trainer.default_root_dir, CHECKPOINT_DIR)
        callbacks.append(RunCheckpoint(dirpath=folder, every_n_train_steps=every, resuming=ckpt_path is not None))
        extra["enable_checkpointing"] = True
    trainer = instantiate(trainer_config(cfg), callbacks=callbacks, logger=loggers or False, **extra)
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    for cb in callbacks:
        if isinstance(cb, RunSummary) and cb.summary:
            return cb.summary
    # ddp_spawn trains in child processes: their callbacks wrote summary.json, this process's copies stay empty.
    path = os.path.join(trainer.default_root_dir, SUMMARY_FILE)
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {
        k.replace("val/loss", "final_val_loss"): float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1
    }


def _write_status(
    output_dir: str, status: str, error: BaseException | None = None, signal_name: str | None = None
) -> None:
    """``<job dir>/job_status.json``: whether the job finished (or which signal interrupted it); seqmem-report lists
    the jobs that did not."""
    record: dict[str, Any] = {"status": status}
    if signal_name is not None:
        record["signal"] = signal_name
    if error is not None:  # a user's mistake keeps the class of the error it reports (errors.UserMistake)
        cause = error.__cause__ if type(error).__name__ == "UserMistake" and error.__cause__ is not None else error
        record["error"] = f"{type(cause).__name__}: {error}"[:2000]
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, JOB_STATUS_FILE), "w") as f:
        json.dump(record, f, indent=2)


def _hydra_entry() -> None:
    import hydra

    @hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")
    def _main(cfg) -> float | None:
        from hydra.core.hydra_config import HydraConfig

        from lightning_seqmem.apps.console import (
            log_each_line_once,
            no_bars_unless_a_terminal,
            quiet_upstream_noise,
        )
        from lightning_seqmem.apps.errors import for_hydra
        from lightning_seqmem.apps.overrides import job_started
        from lightning_seqmem.apps.stops import print_stop, stop_on_signals, stopped_by
        from lightning_seqmem.messages import set_surface

        job_started()

        quiet_upstream_noise()
        no_bars_unless_a_terminal()
        log_each_line_once()  # after Hydra has set up the job's logging
        stop_on_signals()
        set_surface("hydra")  # messages spell a fix as data.<key>=<value>
        output_dir = HydraConfig.get().runtime.output_dir
        if _is_rank_zero():
            _write_status(output_dir, RUNNING)
        try:
            summary = train(cfg)
        except BaseException as err:  # KeyboardInterrupt too: the report must not count this job as finished
            why = stopped_by(err)
            if _is_rank_zero():
                _write_status(output_dir, INTERRUPTED if why else FAILED, None if why else err, why)
                if why:
                    given = HydraConfig.get().overrides
                    fixed = [o for o in given.hydra if o.startswith("hydra.run.dir=")]  # resume into that folder
                    print_stop(output_dir, [*given.task, *fixed], why, log)
            if why == "SIGINT":
                raise SystemExit(128 + 2) from None  # as a shell reports a Ctrl-C; Lightning's own exit is 1
            reported = for_hydra(err, cfg)  # a user's mistake: its message alone (errors.py)
            if reported is err:
                raise
            raise reported from err
        if _is_rank_zero():
            _write_status(output_dir, FINISHED)
        value = summary.get("final_val_loss")
        return float(value) if value is not None else None  # what Hydra sweepers optimise

    _main()


def main() -> None:
    """Console-script entry point (``seqmem-train``): run as a process of its own, it pauses the cyclic collector
    while it imports and keeps the collector's last pass out of its exit (``short_process``: about 3 CPU-seconds,
    more in a task forked by a launcher)."""
    configure_allocator()  # first: torch reads the allocator settings once, when CUDA starts
    from lightning_seqmem.apps.short_process import freeze_for_teardown, pause_gc

    pause_gc(main)  # until train() has imported Lightning
    try:
        sys.argv[1:] = choose_trainer(sys.argv[1:])
        from lightning_seqmem.apps.cluster import run_dir_overrides
        from lightning_seqmem.apps.overrides import overrides_checked

        with overrides_checked(sys.argv[1:], "config"):  # "did you mean", not Hydra's advice to add the key with +
            # torchrun, srun: one folder for the job, rank zero writes it
            sys.argv[1:] = run_dir_overrides(sys.argv[1:])
            _hydra_entry()
    finally:
        freeze_for_teardown(main)


if __name__ == "__main__":
    sys.exit(main())
