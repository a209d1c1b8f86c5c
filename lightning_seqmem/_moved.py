"""Old module paths of the flat layout, kept importable: ``lightning_seqmem.varlen`` is ``training.varlen``.

Before the package had folders every module sat at its top level; users' code, notebooks and configs import those
paths (``from lightning_seqmem.varlen import flash_varlen_kwargs``). A meta-path finder answers an old name with the
module at its new place (the same module object, so patches and ``isinstance`` agree), importing it only when asked.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED: dict[str, str] = {
    "corpus": "data.corpus",
    "tokenizer": "data.tokenizer",
    "token_cache": "data.token_cache",
    "tokens": "data.tokens",
    "arrow_stream": "data.arrow_stream",
    "file_reads": "data.file_reads",
    "data_source": "data.data_source",
    "packing": "batching",
    "bin_packing": "batching.bin_packing",
    "packed_rows": "batching.packed_rows",
    "streaming_packer": "batching.streaming_packer",
    "plan_cache": "batching.plan_cache",
    "strategies": "batching.strategies",
    "collate": "batching.collate",
    "sampling": "batching.sampling",
    "truncation": "batching.truncation",
    "model": "training.model",
    "loss": "training.loss",
    "varlen": "training.varlen",
    "attention": "training.attention",
    "metrics": "training.metrics",
    "final_validation": "training.final_validation",
    "progress": "training.progress",
    "train": "apps.train",
    "cli": "apps.cli",
    "plan_app": "apps.plan_app",
    "plan": "apps.planner",
    "cache": "apps.cache",
    "report": "apps.report",
    "plots": "apps.plots",
    "job_record": "apps.job_record",
    "summary": "apps.summary",
    "console": "apps.console",
}


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, package: str) -> None:
        self.package = package

    def _new_name(self, fullname: str) -> str | None:
        head, _, name = fullname.rpartition(".")
        return f"{self.package}.{MOVED[name]}" if head == self.package and name in MOVED else None

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if self._new_name(fullname) else None

    def create_module(self, spec):
        return importlib.import_module(self._new_name(spec.name))

    def exec_module(self, module) -> None:
        """The module ran at its new place already."""


def register(package: str) -> None:
    """Answer ``package.<old name>`` imports (once per process)."""
    if not any(isinstance(f, _OldPaths) and f.package == package for f in sys.meta_path):
        sys.meta_path.append(_OldPaths(package))
