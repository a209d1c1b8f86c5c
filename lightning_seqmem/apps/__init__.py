"""Entry points and reports: ``seqmem-train`` (Hydra), ``seqmem-cli`` (LightningCLI), ``seqmem-plan`` and its
planner, ``seqmem-cache``, ``seqmem-report`` over sweep folders (``sweep_jobs`` reads them back), plots, the run
summary and per-job records; ``run_files`` names the files a run leaves in its folder."""
