"""Import, once per test process, what a ``seqmem-train`` / ``seqmem-cli`` / ``seqmem-plan`` job imports, so that
each job a test forks (``_forked_app.run_forked_main``, ``_forked_ranks.run_ranks``) inherits it instead of importing
it again: about 2 CPU-s per job (``datasets`` with pandas and pyarrow, Hydra, the model classes, the package's own
modules). The job runs as before; only who paid for its imports changes.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

THIRD_PARTY = (
    "datasets",
    "hydra._internal.utils",
    "hydra.core.utils",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
)


@functools.cache
def import_job_modules() -> None:
    """Every module of ``lightning_seqmem`` (its YAML config package aside) and the libraries a job loads lazily."""
    import lightning_seqmem

    for module in pkgutil.walk_packages(lightning_seqmem.__path__, "lightning_seqmem."):
        if not module.name.startswith("lightning_seqmem.conf"):
            importlib.import_module(module.name)
    for name in THIRD_PARTY:
        importlib.import_module(name)
