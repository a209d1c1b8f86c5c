"""``seqmem-cli``: a LightningCLI over ``CausalLM`` and ``SeqMemDataModule``, for people who configure in YAML.

Both classes are in subclass mode, so a config (or the command line) can name a subclass of either, or any
LightningModule/LightningDataModule; without one, ``lightning_seqmem.CausalLM`` and
``lightning_seqmem.SeqMemDataModule`` are used. The DataModule's batching is an object too (``Pad``, ``Truncate``,
``Pack``, by class_path or short name, with only its own options). Callbacks are added the Lightning way::

    seqmem-cli fit --config examples/cli.yaml
    seqmem-cli fit --data.batching=Pack --data.batching.method=wrapped --data.eval_batching=Pad
    seqmem-cli fit --trainer.max_steps=100 \\
        --trainer.callbacks+=lightning_seqmem.warmup.SeqLengthWarmup --trainer.callbacks.duration=0.3
    seqmem-cli fit --config examples/cli.yaml --print_config > full.yaml && seqmem-cli fit --config full.yaml

The CUDA allocator is configured before torch is imported. The progress bar counts optimizer steps
(``StepProgressBar``) unless the config names another or turns it off, and upstream deprecation noise is
silenced in this process (``lightning_seqmem.apps.console``).
"""

from __future__ import annotations

import sys

from lightning_seqmem.memory.allocator import configure_allocator

DEFAULT_MODEL = "lightning_seqmem.CausalLM"
DEFAULT_DATA = "lightning_seqmem.SeqMemDataModule"


def build_cli_class():
    """The LightningCLI subclass (built lazily so that importing this module does not import torch)."""
    from lightning.pytorch import LightningDataModule, LightningModule, Trainer
    from lightning.pytorch.callbacks import ProgressBar
    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

    from lightning_seqmem.training.progress import StepProgressBar

    class SeqMemCLI(LightningCLI):
        """LightningCLI with our model and DataModule as defaults and a progress bar over optimizer steps."""

        def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
            parser.set_defaults({"model": {"class_path": DEFAULT_MODEL}, "data": {"class_path": DEFAULT_DATA}})

        def instantiate_trainer(self, **kwargs) -> Trainer:
            config = self._get(self.config_init, "trainer", default={})
            callbacks = config.get("callbacks") or []
            callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
            wants_bar = config.get("enable_progress_bar") is not False and "callbacks" not in kwargs
            if wants_bar and not any(isinstance(cb, ProgressBar) for cb in callbacks):
                kwargs["callbacks"] = [*callbacks, StepProgressBar()]
            return super().instantiate_trainer(**kwargs)

    def run(args: list[str] | None = None, run: bool = True) -> LightningCLI:
        return SeqMemCLI(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            args=args,
            run=run,
        )

    return SeqMemCLI, run


def cli_main(args: list[str] | None = None, run: bool = True):
    """Build (and by default run) the CLI; ``args`` as on the command line, ``None`` reads ``sys.argv``."""
    from lightning_seqmem.apps.short_process import resume_gc

    _, make = build_cli_class()
    resume_gc()  # Lightning imported (main paused the collector): it runs again for the data, the model, the fit
    return make(args, run=run)


def main() -> None:
    """Console-script entry point (``seqmem-cli``): as ``seqmem-train``, its imports without the cyclic collector and
    its exit without the collector's last pass (``short_process``)."""
    configure_allocator()  # first: torch reads the allocator settings once, when CUDA starts
    from lightning_seqmem.apps.short_process import freeze_for_teardown, pause_gc

    pause_gc(main)  # until cli_main has imported Lightning
    try:
        from lightning_seqmem.apps.console import no_bars_unless_a_terminal, quiet_upstream_noise
        from lightning_seqmem.apps.errors import exit_on_user_mistake
        from lightning_seqmem.messages import set_surface

        set_surface("cli")  # messages spell a fix as --data.<key> <value>
        quiet_upstream_noise()
        no_bars_unless_a_terminal()
        exit_on_user_mistake(cli_main)
    finally:
        freeze_for_teardown(main)


if __name__ == "__main__":
    sys.exit(main())
