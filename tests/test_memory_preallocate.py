"""CachePreallocator: a worst-case step that changes nothing, survives empty_cache, and fails clearly on OOM."""

import lightning.pytorch as L
import pytest
import torch
from _forked_ranks import run_ranks
from _memory_ddp_script import main as ddp_rank
from _memory_helpers import VOCAB, Probe, TinyData, TinyLM, assert_same, trainer

from lightning_seqmem.memory import preallocate
from lightning_seqmem.memory.preallocate import CachePreallocator, PreallocationOOMError


def test_init_checks_arguments():
    with pytest.raises(ValueError, match="both rows and length"):
        CachePreallocator(rows=2)
    with pytest.raises(ValueError, match="positive int"):
        CachePreallocator(rows=0, length=8)
    with pytest.raises(TypeError, match="sequence of str"):
        CachePreallocator(rows=1, length=8, keys="input_ids")


def test_leaves_everything_bit_identical_and_the_run_unchanged(tmp_path):
    """Probe before and after the pass see identical state; the trained weights equal a run without the callback."""

    def fit(with_prealloc):
        L.seed_everything(0)
        model, before, after = TinyLM(), Probe(), Probe()
        callbacks = [before, CachePreallocator(), after] if with_prealloc else []
        trainer(tmp_path, callbacks, max_steps=3).fit(model, datamodule=TinyData())
        return model, before, after

    model, before, after = fit(True)
    assert_same(before.state, after.state)
    dummy = model.seen[0]
    assert dummy["shape"] == (2, 48)  # the DataModule's max_batch_shape, not a real batch (those are shorter)
    assert not torch.equal(dummy["rng"], before.state["torch"])  # dropout did consume RNG during the pass ...
    assert len(model.seen) == 4  # ... and the pass ran once (CPU: no re-reservation), then 3 real steps
    plain, _, _ = fit(False)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), f"{name} differs from a run without pre-allocation"
    assert model.real_tokens_seen == plain.real_tokens_seen


def test_records_peak_rss_on_cpu(tmp_path):
    cb = CachePreallocator()
    trainer(tmp_path, [cb], max_steps=1).fit(TinyLM(), datamodule=TinyData())
    assert cb.report.shapes == [(2, 48)] and cb.report.passes == ["fit_start"]
    assert cb.report.peak_rss >= cb.report.rss_before > 0
    assert "fits on cpu" in cb.report.summary()


class _Warmup(L.Callback):
    """Stands in for SeqLengthWarmup in reshape mode: more rows of fewer tokens."""

    def max_warmup_shape(self, rows, length):
        return rows * 4, length // 4


def test_asks_warmup_for_its_worst_case_and_uses_datamodule_keys(tmp_path):
    model, cb = TinyLM(), CachePreallocator()
    trainer(tmp_path, [_Warmup(), cb], max_steps=1).fit(model, datamodule=TinyData(rows=2, max_length=64, eval_rows=3))
    assert cb.report.shapes == [(12, 16)]  # asked with the DataModule's (3, 64): the eval batch is the larger
    assert model.seen[0]["shape"] == (12, 16) and model.seen[1]["shape"] != (12, 16)  # one pass, then real batches
    assert model.seen[0]["keys"] == ("input_ids", "attention_mask", "labels")


class _Reshaper(L.Callback):
    def __init__(self, row_factor, length_divisor):
        self.row_factor, self.length_divisor = row_factor, length_divisor

    def max_warmup_shape(self, rows, length):
        return rows * self.row_factor, length // self.length_divisor


def test_shapes_inside_another_need_no_pass(tmp_path):
    cb = CachePreallocator()
    callbacks = [_Reshaper(1, 2), _Reshaper(2, 2), _Reshaper(4, 4), cb]
    trainer(tmp_path, callbacks, max_steps=1).fit(TinyLM(), datamodule=TinyData())
    assert cb.report.shapes == [(4, 24), (8, 12)]  # (2, 24) fits inside (4, 24); most tokens, then longest first


def test_explicit_shape_and_packed_keys_without_datamodule(tmp_path):
    data = TinyData()  # its loader only: no DataModule is passed to fit
    model = TinyLM(vocab_size=VOCAB)
    cb = CachePreallocator(rows=3, length=40, keys=("input_ids", "labels", "position_ids"))
    trainer(tmp_path, [cb], max_steps=1).fit(model, train_dataloaders=data.train_dataloader())
    assert model.seen[0]["shape"] == (3, 40)
    assert model.seen[0]["keys"] == ("input_ids", "labels", "position_ids")
    assert model.seen[0]["max_id"] < VOCAB  # valid ids from model.config.vocab_size


def test_needs_a_shape(tmp_path):
    with pytest.raises(Exception, match="max_batch_shape"):
        loader = TinyData().train_dataloader()
        trainer(tmp_path, [CachePreallocator()], max_steps=1).fit(TinyLM(), train_dataloaders=loader)


class _OOMLM(TinyLM):
    """Runs out of memory (simulated) above a token budget, like a GPU would."""

    def training_step(self, batch, batch_idx):
        self.dropout(torch.ones(8))  # consume RNG before failing
        if batch["input_ids"].numel() > 64:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which "
                "1.00 GiB is free."
            )
        return super().training_step(batch, batch_idx)


def test_oom_gives_shape_memory_and_fixes(tmp_path):
    model, before = _OOMLM(), Probe()
    with pytest.raises(PreallocationOOMError) as info:
        trainer(tmp_path, [before, CachePreallocator()], max_steps=1).fit(model, datamodule=TinyData(rows=4))
    message = str(info.value)
    assert isinstance(info.value, torch.OutOfMemoryError)
    for needle in (
        "rows=4, length=48",
        "192 tokens",
        "Memory needed",
        "available",
        "micro_batch_size",
        "max_length",
        "max_tokens_per_batch",
        "gradient checkpointing",
        "bf16",
        "Tried to allocate",
    ):
        assert needle in message, needle
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), before.state["torch"])


def test_oom_on_simulated_cuda_reports_needed_vs_free(tmp_path, monkeypatch):
    gib = 1024**3
    monkeypatch.setattr(preallocate, "_is_cuda", lambda device: True)
    monkeypatch.setattr(preallocate, "_cuda_reset_peak", lambda device: None)
    monkeypatch.setattr(preallocate, "_cuda_allocated", lambda device: 30 * gib)
    monkeypatch.setattr(preallocate, "_cuda_peak_allocated", lambda device: 70 * gib)
    monkeypatch.setattr(preallocate, "_cuda_mem_get_info", lambda device: (1 * gib, 80 * gib))
    expected = r"at least 42.00 GiB on top of the 30.00 GiB already held .*; available: 1.00 GiB free of 80.00 GiB"
    with pytest.raises(PreallocationOOMError, match=expected):
        trainer(tmp_path, [CachePreallocator()], max_steps=1).fit(_OOMLM(), datamodule=TinyData(rows=4))


class _Events(L.Callback):
    def __init__(self, events, fake=None):
        self.events, self.fake = events, fake

    def on_fit_start(self, trainer, pl_module):
        self.events.append("on_fit_start")

    def on_train_start(self, trainer, pl_module):
        self.events.append("on_train_start")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.events.append("on_train_batch_start")
        if self.fake is not None and batch_idx == 0:
            self.fake["reserved_at_first_batch"] = self.fake["reserved"]


def test_lightning_empties_the_cache_after_on_fit_start_and_not_after_on_train_start(tmp_path, monkeypatch):
    """The fact the design rests on, checked against the installed Lightning (a mock records empty_cache calls)."""
    events = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    trainer(tmp_path, [_Events(events)], max_steps=1, limit_val_batches=1, num_sanity_val_steps=1).fit(
        TinyLM(), datamodule=TinyData()
    )
    first = events.index("on_train_batch_start")
    assert events.index("on_fit_start") < events.index("empty_cache") < events.index("on_train_start") < first
    assert "empty_cache" not in events[events.index("on_train_start") : first]


class _FakeAllocatorLM(TinyLM):
    """Simulates the caching allocator on CPU: a step reserves bytes proportional to its tokens."""

    def __init__(self, fake):
        super().__init__()
        self.fake = fake

    def training_step(self, batch, batch_idx):
        self.fake["reserved"] = max(self.fake["reserved"], batch["input_ids"].numel() * 1000)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("rereserve", [True, False])
def test_reservation_is_in_place_at_the_first_batch_on_simulated_cuda(tmp_path, monkeypatch, rereserve):
    fake = {"reserved": 0}
    monkeypatch.setattr(preallocate, "_is_cuda", lambda device: True)
    monkeypatch.setattr(preallocate, "_cuda_reset_peak", lambda device: None)
    monkeypatch.setattr(preallocate, "_cuda_peak_allocated", lambda device: fake["reserved"])
    monkeypatch.setattr(preallocate, "_cuda_reserved", lambda device: fake["reserved"])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: fake.update(reserved=0))  # what resume_end does
    cb = CachePreallocator(rereserve=rereserve)
    model = _FakeAllocatorLM(fake)
    trainer(tmp_path, [cb, _Events([], fake)], max_steps=1).fit(model, datamodule=TinyData())
    worst = 2 * 48 * 1000
    if rereserve:
        assert cb.report.passes == ["fit_start", "train_start"]
        assert fake["reserved_at_first_batch"] == worst
    else:  # without the second pass empty_cache would have handed the reservation back
        assert cb.report.passes == ["fit_start"] and fake["reserved_at_first_batch"] == 0


def test_with_real_causallm_and_seqmem_datamodule(tmp_path, small_text_dataset):
    from lightning_seqmem import CausalLM, SeqMemDataModule

    L.seed_everything(0)
    dm = SeqMemDataModule(dataset=small_text_dataset, max_length=64, micro_batch_size=2)
    model = CausalLM(
        model_config=dict(
            model_type="llama",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            attention_dropout=0.1,
        )
    )
    shapes = []
    setup = model.setup

    def hook_the_built_model(stage):  # the Hugging Face model exists after setup; the loss layer calls it
        setup(stage)
        model.model.register_forward_pre_hook(
            lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
        )

    model.setup = hook_the_built_model
    before, after, cb = Probe(), Probe(), CachePreallocator()
    trainer(tmp_path, [before, cb, after], max_steps=2).fit(model, datamodule=dm)
    assert_same(before.state, after.state)  # includes CausalLM.real_tokens_seen
    assert shapes[0] == dm.max_batch_shape() == cb.report.shapes[0]
    assert cb.report.keys == dm.batch_keys()


@pytest.mark.slow
def test_ddp_two_ranks_run_the_pass_and_stay_in_step():
    """Every rank runs the pass through the unwrapped module (no all-reduce, no hang), its state is left bit-identical
    (checked on each rank), and DDP then trains with synced gradients: both ranks end with the same weights."""
    ranks = run_ranks(ddp_rank)
    assert all(torch.equal(ranks[0][name], ranks[1][name]) for name in ranks[0])


def test_with_seq_length_warmup_in_reshape_mode(tmp_path, small_text_dataset):
    from lightning_seqmem import CausalLM, SeqMemDataModule
    from lightning_seqmem.warmup.callback import SeqLengthWarmup

    dm = SeqMemDataModule(dataset=small_text_dataset, max_length=64, micro_batch_size=2)
    model = CausalLM(
        model_config=dict(
            model_type="llama",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
        )
    )
    warmup = SeqLengthWarmup(duration=0.5, min_seq_length=8, max_seq_length=32, truncate=False)
    cb = CachePreallocator()
    with pytest.warns(UserWarning, match="reshaped into extra rows"):  # 64-token rows, max 32: reshaped on purpose
        trainer(tmp_path, [warmup, cb], max_steps=2).fit(model, datamodule=dm)
    assert cb.report.shapes == [warmup.max_warmup_shape(*dm.max_batch_shape())] == [(4, 32)]


def test_says_once_that_the_modules_training_step_meets_a_synthetic_batch(tmp_path, caplog):
    caplog.set_level("INFO")
    trainer(tmp_path, [CachePreallocator()], max_steps=2).fit(TinyLM(), datamodule=TinyData())
    said = [r.getMessage() for r in caplog.records if "synthetic batch" in r.getMessage()]
    assert len(said) == 1 and "TinyLM.training_step(batch, 0) and backward run once" in said[0] and "2x48" in said[0]
