"""Entry points and reports: ``seqmem-train`` (Hydra), ``seqmem-cli`` (LightningCLI), ``seqmem-plan`` and its
planner, ``seqmem-cache``, ``seqmem-report`` over sweep folders, plots, the run summary and per-job records."""
