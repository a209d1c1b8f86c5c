"""MemoryMonitor and the memory arithmetic it uses (CUDA simulated with fake memory_stats dicts)."""

import types

import pytest
import torch
from _memory_helpers import TinyData, TinyLM, trainer
from lightning.pytorch.loggers import Logger

from lightning_seqmem.memory import monitor, stats
from lightning_seqmem.memory.monitor import MemoryMonitor

GIB = 1024**3


class _ListLogger(Logger):
    name, version = "list", 0

    def __init__(self):
        super().__init__()
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def test_stats_arithmetic():
    assert stats.stranded_share(1.0, 4.0) == 0.25 and stats.stranded_share(0, 0) == 0.0
    assert stats.format_bytes(1536 * 2**20) == "1.50 GiB" and stats.format_bytes(None) == "unknown"
    assert stats.parse_tried_to_allocate("CUDA out of memory. Tried to allocate 20.00 MiB.") == 20 * 2**20
    assert stats.parse_tried_to_allocate("no size here") is None
    metrics = stats.cuda_memory_metrics(
        {
            "allocated_bytes.all.current": GIB,
            "reserved_bytes.all.current": 4 * GIB,
            "inactive_split_bytes.all.current": GIB // 2,
            "num_alloc_retries": 3,
            "num_device_alloc": 7,
        }
    )
    assert metrics == {
        "allocated_gib": 1.0,
        "reserved_gib": 4.0,
        "inactive_split_gib": 0.5,
        "num_alloc_retries": 3.0,
        "num_device_alloc": 7.0,
        "fragmentation": 0.125,
    }
    assert stats.memory_advice(0, 0.01, 0.2) is None
    assert "expandable segments" in stats.memory_advice(2, 0.01, 0.2)
    assert "fragmentation 50%" in stats.memory_advice(0, 0.5, 0.2)


def test_fragmentation_is_what_split_blocks_strand_at_the_peak():
    """A pre-allocated run after a small step: 30 of 36 GiB reserved are free but reusable, 0.2 GiB stranded in split
    blocks at the peak. The old figure, (reserved - allocated) / reserved, called that 83 % fragmentation."""
    after_small_step = {
        "allocated_bytes.all.current": 6 * GIB,
        "reserved_bytes.all.current": 36 * GIB,
        "reserved_bytes.all.peak": 36 * GIB,
        "inactive_split_bytes.all.current": GIB // 10,
        "inactive_split_bytes.all.peak": GIB // 5,
    }
    metrics = stats.cuda_memory_metrics(after_small_step)
    assert metrics["fragmentation"] == pytest.approx(0.2 / 36)
    fragmented = stats.cuda_memory_metrics({**after_small_step, "inactive_split_bytes.all.peak": 9 * GIB})
    assert fragmented["fragmentation"] == 0.25


def test_advice_never_suggests_what_the_run_already_has():
    advice = stats.memory_advice(2, 0.3, 0.2)
    assert "expandable segments" in advice and "add CachePreallocator" in advice
    advice = stats.memory_advice(2, 0.3, 0.2, preallocating=True, expandable=True)
    assert "CachePreallocator" not in advice and "expandable" not in advice and "keep shapes steady" in advice


def test_init_checks_arguments():
    with pytest.raises(ValueError, match="every_n_steps"):
        MemoryMonitor(every_n_steps=0)
    with pytest.raises(ValueError, match="fragmentation_threshold"):
        MemoryMonitor(fragmentation_threshold=1.5)


def test_logs_rss_on_cpu_every_n_steps(tmp_path):
    logger, cb = _ListLogger(), MemoryMonitor(every_n_steps=2)
    trainer(tmp_path, [cb], max_steps=5, logger=logger).fit(TinyLM(), datamodule=TinyData())
    assert [row["step"] for row in cb.history] == [1, 2, 4, 5]  # first step, every 2nd, and the end of fit
    ours = [(step, m) for step, m in logger.rows if "memory/rss_gib" in m]
    assert [step for step, _ in ours] == [1, 2, 4]
    assert ours[0][1]["memory/peak_rss_gib"] >= ours[0][1]["memory/rss_gib"] > 0
    assert cb.summary["steps"] == 5 and cb.summary["peak_rss_gib"] > 0


def test_counts_optimizer_steps_not_micro_batches(tmp_path):
    cb = MemoryMonitor(every_n_steps=1)
    trainer(tmp_path, [cb], max_steps=2, accumulate_grad_batches=2).fit(TinyLM(), datamodule=TinyData())
    assert [row["step"] for row in cb.history] == [1, 2]


def _fake_cuda(monkeypatch, reserved_gib, retries, stranded_gib=0.0):
    """Every memory_stats() call returns the next fake reading; the run trains on (simulated) cuda:0."""
    readings = iter(
        {
            "allocated_bytes.all.current": 1 * GIB,
            "reserved_bytes.all.current": int(r * GIB),
            "allocated_bytes.all.peak": 2 * GIB,
            "reserved_bytes.all.peak": int(max(reserved_gib) * GIB),
            "inactive_split_bytes.all.peak": int(stranded_gib * GIB),
            "num_alloc_retries": retries,
            "num_ooms": 0,
            "num_device_alloc": 4,
        }
        for r in reserved_gib
    )
    monkeypatch.setattr(monitor, "_training_device", lambda trainer: torch.device("cuda", 0))
    monkeypatch.setattr(monitor, "_is_cuda", lambda device: device.type == "cuda")
    monkeypatch.setattr(monitor, "_cuda_stats", lambda device: next(readings))


def test_summary_and_warning_on_simulated_cuda(tmp_path, monkeypatch):
    _fake_cuda(monkeypatch, [2.0, 2.5, 4.0], retries=3, stranded_gib=1.0)
    monkeypatch.setattr(monitor, "expandable_segments_on", lambda: False)
    cb = MemoryMonitor(every_n_steps=1)
    with pytest.warns(UserWarning, match="3 allocation retries.*fragmentation 25%.*expandable segments"):
        trainer(tmp_path, [cb], max_steps=3).fit(TinyLM(), datamodule=TinyData())
    assert cb.summary["reserved_after_first_step_gib"] == 2.0
    assert cb.summary["reserved_growth_gib"] == 2.0
    assert cb.summary["max_fragmentation"] == 0.25
    assert cb.summary["num_alloc_retries"] == 3 and cb.summary["num_device_alloc"] == 4


def test_quiet_when_memory_is_steady(tmp_path, monkeypatch, recwarn):
    _fake_cuda(monkeypatch, [1.02, 1.02, 1.02], retries=0)
    cb = MemoryMonitor(every_n_steps=1)
    trainer(tmp_path, [cb], max_steps=3).fit(TinyLM(), datamodule=TinyData())
    assert cb.summary["reserved_growth_gib"] == 0.0
    assert not [w for w in recwarn if "allocation retries" in str(w.message) or "fragmentation" in str(w.message)]


def test_fit_ending_off_a_logging_step_reads_the_device_it_trained_on(tmp_path, monkeypatch):
    """On a GPU Lightning moves the module back to the CPU before on_fit_end; the last row must still be CUDA's
    (it was CPU metrics, and the summary died with KeyError 'reserved_gib'). Simulated: the run trains on cuda:0
    while the module stays on the CPU, and steps 1 and 5 of 7 are logged."""
    _fake_cuda(monkeypatch, [2.0, 2.0, 2.0], retries=0)
    cb = MemoryMonitor(every_n_steps=5)
    trainer(tmp_path, [cb], max_steps=7).fit(TinyLM(), datamodule=TinyData())
    assert [row["step"] for row in cb.history] == [1, 5, 7]
    assert all("reserved_gib" in row and "rss_gib" not in row for row in cb.history)
    assert cb.summary["steps"] == 7 and cb.summary["reserved_growth_gib"] == 0.0


def test_no_advice_to_add_the_preallocator_the_run_has(tmp_path, monkeypatch):
    from lightning_seqmem.memory.preallocate import CachePreallocator

    _fake_cuda(monkeypatch, [2.0, 2.0], retries=1)
    monkeypatch.setattr(monitor, "expandable_segments_on", lambda: True)
    monkeypatch.setattr(CachePreallocator, "on_fit_start", lambda *args: None)  # the pass itself is tested elsewhere
    with pytest.warns(UserWarning, match="1 allocation retries") as warned:
        trainer(tmp_path, [CachePreallocator(), MemoryMonitor(every_n_steps=1)], max_steps=2).fit(
            TinyLM(), datamodule=TinyData()
        )
    advice = [str(w.message) for w in warned if "allocation retries" in str(w.message)]
    assert advice and not any("CachePreallocator" in a or "expandable" in a for a in advice)


def test_dumps_a_snapshot_on_oom(tmp_path, monkeypatch):
    written = []
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", written.append)
    cb = MemoryMonitor(snapshot_dir=str(tmp_path / "snaps"))
    cuda = types.SimpleNamespace(root_device=torch.device("cuda", 0))
    fake_trainer = types.SimpleNamespace(global_rank=0, strategy=cuda)
    cuda_module = types.SimpleNamespace(device=torch.device("cuda", 0))
    cb.on_exception(fake_trainer, cuda_module, ValueError("not an OOM"))
    assert written == []
    with pytest.warns(UserWarning, match="memory_viz"):
        cb.on_exception(fake_trainer, cuda_module, torch.OutOfMemoryError("CUDA out of memory"))
    assert written == [str(tmp_path / "snaps" / "oom_rank0.pickle")] == [cb.snapshot_path]
