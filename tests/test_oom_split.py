"""``on_oom="split"``: an out-of-memory micro-batch is run again in parts, and training ends on the same weights.

The GPU running out of memory is stood in for by :class:`OomInjector`: ``torch.OutOfMemoryError`` raised by a hook on
one module of the model (the Hugging Face model, a decoder layer) when it is fed more than N tokens, in its forward or
in the backward through it — where the CUDA caching allocator raises it on a GPU. Every run is compared with the
same run on ``on_oom="raise"`` and no injection: the weights after training agree within float reassociation.
"""

import lightning.pytorch as L
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from lightning_seqmem import DPO, CausalLM
from lightning_seqmem.batch import COMPLETION_MASK, SEQUENCE_INDEX
from lightning_seqmem.memory.worst_batch import make_dummy_batch
from lightning_seqmem.oom.runner import OomSplitter, RowDoesNotFit
from lightning_seqmem.oom.split import OomInjector, batch_tokens, pre_split, split_batch

VOCAB = 97
TINY = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
TOL = 1e-6


def padded(rows=4, length=24, seed=0, short=(1, 9)):
    """Rows of different real lengths (right padding), so the two halves hold different token counts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    for row, keep in zip(short, (7, 15)):
        if row < rows:
            mask[row, keep:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :5] = -100  # a prompt without loss
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def packed(rows=1, seed=0):
    layout = ((5, 9, 4, 6), (12, 3, 7))[:rows] if rows <= 2 else tuple((5, 9, 4, 6) for _ in range(rows))
    return make_dummy_batch(rows, 24, ("input_ids", "labels", "position_ids"), VOCAB, seed=seed, layout=layout)


def _model(cls=CausalLM, **kwargs):
    torch.manual_seed(0)
    return cls(model_config=TINY, vocab_size=VOCAB, pad_token_id=0, **kwargs)


def _fit(model, batches, accumulate=1, epochs=1, **trainer_kwargs):
    L.seed_everything(0)
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accumulate_grad_batches=accumulate,
        **trainer_kwargs,
    )
    trainer.fit(model, DataLoader(batches, batch_size=None))
    return trainer


def _weights(model):
    return {n: p.detach().clone() for n, p in model.model.named_parameters()}


def worst_relative(a, b):
    """Relative L2 distance of all weights (or gradients) together: parts add in another order than one batch, and
    Adam's first steps (sign-like) turn that rounding into ~1e-6 of single entries whose gradient nearly cancels."""
    diff = torch.cat([(a[n] - b[n]).flatten() for n in b])
    return (diff.norm() / torch.cat([t.flatten() for t in b.values()]).norm()).item()


def _unsplit(batches, accumulate=1, cls=CausalLM, **kwargs):
    model = _model(cls, **kwargs)
    _fit(model, batches, accumulate)
    return _weights(model)


def _split(batches, injector, accumulate=1, cls=CausalLM, module=lambda m: m.model, **kwargs):
    model = _model(cls, on_oom="split", **kwargs)
    handle = injector.install(module(model))
    trainer = _fit(model, batches, accumulate)
    handle.remove()
    return model, trainer


# ------------------------------------------------------------------------------------------------ pure cuts
def test_halves_keep_rows_and_documents():
    batch = padded(rows=5)
    first, second = split_batch(batch)
    assert first["input_ids"].shape[0] == 2 and second["input_ids"].shape[0] == 3
    assert torch.equal(torch.cat([first["labels"], second["labels"]]), batch["labels"])
    row = packed(rows=1)  # documents of 5, 9, 4, 6 tokens: the start nearest the middle is 14
    left, right = split_batch(row)
    assert left["input_ids"].shape[1] == 14 and int(right["position_ids"][0, 0]) == 0
    assert split_batch(padded(rows=1)) is None  # one padded row: one document
    one_doc = make_dummy_batch(1, 24, ("input_ids", "labels", "position_ids"), VOCAB, layout=((24,),))
    assert split_batch(one_doc) is None


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), limit=st.integers(1, 200))
def test_pre_split_parts_cover_the_batch(rows, limit):
    """Whatever the remembered size, the parts hold every row (every token) once, each below the size or uncuttable."""
    batch = packed(rows=rows) if rows > 2 else padded(rows=rows)
    parts = pre_split(batch, limit)
    assert sum(int((p["labels"] != -100).sum()) for p in parts) == int((batch["labels"] != -100).sum())
    assert all(batch_tokens(p) < limit or split_batch(p) is None for p in parts)


def test_runner_gives_the_unsplit_gradient_wherever_backward_fails():
    """A backward that fails halfway leaves the parameters nearest the loss with their share: they get zeros from
    the halves, the others the halves' sum (fp32, ≤ 1e-6 of the unsplit gradient)."""
    model = _model().model
    batch = packed(rows=2)
    n = int((batch["labels"][:, 1:] != -100).sum())

    def forward(part):
        return model(**part, num_items_in_batch=n, use_cache=False).loss, {}

    forward(batch)[0].backward()
    reference = {k: p.grad.clone() for k, p in model.named_parameters()}
    for layer in range(2):
        model.zero_grad(set_to_none=True)
        handle = OomInjector(30, where="backward", times=1).install(model.model.layers[layer])
        splitter = OomSplitter()
        splitter.run(batch, forward, lambda loss: loss.backward(), model.parameters())
        handle.remove()
        assert splitter.splits == 1 and splitter.limit == 48
        assert worst_relative({k: p.grad for k, p in model.named_parameters()}, reference) <= TOL


# ------------------------------------------------------------------------------------------- real Trainer
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_padded_and_packed_batches_train_to_the_same_weights(where):
    batches = [padded(rows=4, seed=0), packed(rows=2, seed=1), padded(rows=4, seed=2), packed(rows=1, seed=3)]
    reference = _unsplit(batches)
    model, trainer = _split(batches, OomInjector(40, where=where))
    assert worst_relative(_weights(model), reference) <= TOL
    assert model.oom_splits >= 2 and model._oom.limit is not None
    assert trainer.callback_metrics["train/oom_splits"] == model.oom_splits


@pytest.mark.slow
def test_oom_on_the_second_micro_batch_keeps_the_first_ones_gradient():
    """Accumulation over 3: only the second micro-batch is too large; its layer-0 forward fails."""
    batches = [padded(rows=2, seed=0), padded(rows=4, seed=1), padded(rows=2, seed=2)] * 2
    for normalization in ("token", "micro_batch"):
        reference = _unsplit(batches, accumulate=3, loss_normalization=normalization)
        model, _ = _split(
            batches,
            OomInjector(60, where="forward"),
            accumulate=3,
            module=lambda m: m.model.model.layers[0],
            loss_normalization=normalization,
        )
        assert worst_relative(_weights(model), reference) <= TOL
        assert [e["tokens"] for e in model.oom_events] == [96]  # the second time, split before it runs


def test_a_single_row_too_large_stops_with_the_fixes():
    model = _model(on_oom="split")
    OomInjector(10).install(model.model)
    with pytest.raises(RowDoesNotFit, match=r"train step 0: a single row of 24 tokens.*max_length.*seqmem-plan"):
        _fit(model, [padded(rows=1)])


@pytest.mark.parametrize("cls", [CausalLM, DPO])
def test_validation_and_test_batches_split_too(cls):
    batches = [padded(rows=4, seed=s) for s in range(2)] if cls is CausalLM else [_pairs(False, s) for s in range(2)]
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    loader = DataLoader(batches, batch_size=None)
    plain = _model(cls, cross_entropy="full")
    expected = (
        trainer.validate(plain, loader, verbose=False)[0]["val/loss"],
        trainer.test(plain, loader, verbose=False)[0],
    )
    model = _model(cls, cross_entropy="full", on_oom="split")
    OomInjector(50).install(model.model)
    assert trainer.validate(model, loader, verbose=False)[0]["val/loss"] == pytest.approx(expected[0], rel=1e-6)
    assert {e["stage"] for e in model.oom_events} == {"validation"}
    model._oom.limit = None  # forget the size, so that the test batches fail too
    assert trainer.test(model, loader, verbose=False)[0]["test/loss"] == pytest.approx(expected[1]["test/loss"])
    assert {e["stage"] for e in model.oom_events} == {"validation", "test"}


def _pairs(packed_layout: bool, seed=0, padding=0):
    g = torch.Generator().manual_seed(seed)
    if not packed_layout:  # [2P, L]: 3 pairs, chosen rows then rejected
        ids = torch.randint(1, VOCAB, (6, 16), generator=g)
        completion = torch.zeros_like(ids)
        completion[:, 6:] = 1
        completion[4, 12:] = 0
        mask = torch.ones_like(ids)
        mask[4, 12:] = 0
        labels = ids.masked_fill(completion == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, COMPLETION_MASK: completion, "labels": labels}
    # one packed row: pairs 0 and 1 whole, sequences numbered chosen first (0, 1) then rejected (2, 3), then the
    # collator's padding (sequence -1, its positions counting from 0 as a sequence's do)
    lengths, owners = (6, 5, 7, 6) + ((padding,) if padding else ()), (0, 2, 1, 3, -1)
    ids = torch.randint(1, VOCAB, (1, sum(lengths)), generator=g)
    position = torch.cat([torch.arange(n) for n in lengths])[None]
    index = torch.cat([torch.full((n,), o) for n, o in zip(lengths, owners)])[None]
    completion = ((position >= 3) & (index >= 0)).long()
    return {
        "input_ids": ids,
        "labels": ids.masked_fill(completion == 0, -100),
        "position_ids": position,
        COMPLETION_MASK: completion,
        SEQUENCE_INDEX: index,
    }


@pytest.mark.parametrize("packed_layout, padding, fits", [(False, 0, 60), (True, 0, 20), (True, 24, 40)])
def test_dpo_pairs_split_whole(packed_layout, padding, fits):
    """Padded pairs split by pairs, a packed row between its pairs; a packed row with a padding tail is first run
    without it (a cut at its start, the row's middle here, once left a part of padding alone: an IndexError)."""
    batches = [_pairs(packed_layout, seed=s, padding=padding) for s in range(3)]
    if padding:
        (trimmed,) = split_batch(batches[0])
        assert trimmed["input_ids"].shape[1] == batches[0]["input_ids"].shape[1] - padding
    reference = _unsplit(batches, cls=DPO, cross_entropy="full")
    model, _ = _split(batches, OomInjector(fits), cls=DPO, cross_entropy="full")
    assert model.oom_splits >= 1
    assert worst_relative(_weights(model), reference) <= TOL


def test_on_oom_is_checked():
    with pytest.raises(ValueError, match="on_oom"):
        CausalLM(on_oom="retry")


@pytest.mark.slow
def test_a_datamodule_run_survives_and_reports(small_text_dataset, tokenizer, tmp_path):
    """What a user meets: SeqMemDataModule (packed rows, built-in tokenizer), SeqLengthWarmup, validation,
    MemoryMonitor and RunSummary; the injected out-of-memory errors change nothing in the weights and show in the
    reports."""
    from lightning_seqmem import MemoryMonitor, SeqLengthWarmup, SeqMemDataModule
    from lightning_seqmem.apps.summary import RunSummary

    def run(on_oom, inject):
        dm = SeqMemDataModule(dataset=small_text_dataset, max_length=64, micro_batch_size=4, strategy="pack")
        torch.manual_seed(0)
        model = CausalLM(model_config=TINY, vocab_size=len(tokenizer), on_oom=on_oom)
        if inject:
            OomInjector(128).install(model.model.model.layers[1])
        monitor, summary = MemoryMonitor(every_n_steps=1), RunSummary(print_table=False)
        warmup = SeqLengthWarmup(duration=0.5, min_seq_length=16, max_seq_length=64, step_size=16)
        L.seed_everything(0)
        trainer = L.Trainer(
            max_steps=3,
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=2,
            val_check_interval=3,
            default_root_dir=tmp_path,
            callbacks=[monitor, summary, warmup],
        )
        trainer.fit(model, datamodule=dm)
        return _weights(model), monitor, summary.summary, float(trainer.callback_metrics["val/loss"])

    reference, _, plain, val_loss = run("raise", False)
    weights, monitor, summary, split_val_loss = run("split", True)
    assert "oom_splits" not in plain
    assert worst_relative(weights, reference) <= TOL
    assert split_val_loss == pytest.approx(val_loss, rel=1e-6)  # validation batches of 256 tokens: split before
    assert summary["oom_splits"] == len(monitor.oom_events) == 1  # one failure, remembered for every later batch
    assert summary["oom_split_tokens"] == 256  # 4 rows x 64: halves of 128 fit
    assert monitor.oom_events[0]["step"] >= 1 and monitor.oom_events[0]["tokens"] == 256  # warmup's short rows fit


@pytest.mark.slow
def test_hydra_and_the_cli_take_on_oom(monkeypatch):
    import sys

    from hydra.utils import instantiate
    from test_cli import SMALL
    from test_conf import compose_cfg

    from lightning_seqmem.apps.cli import cli_main

    assert instantiate(compose_cfg(["model.on_oom=split"]).model)._oom is not None
    assert instantiate(compose_cfg([]).model)._oom is None
    monkeypatch.setattr(sys, "argv", ["seqmem-cli"])
    assert cli_main([*SMALL, "--model.on_oom=split"], run=False).model._oom is not None


_MODEL = {}


def _shared_model():
    if not _MODEL:
        _MODEL["lm"] = _model().model
    return _MODEL["lm"]


@settings(max_examples=12, deadline=None)
@given(
    layout=st.sampled_from(["padded", "packed"]),
    rows=st.integers(1, 4),
    module=st.sampled_from(["model", "layer0", "layer1", "head"]),
    where=st.sampled_from(["forward", "backward"]),
    max_tokens=st.integers(10, 100),
    times=st.sampled_from([1, 2, None]),
)
def test_wherever_and_however_often_it_fails_the_gradient_is_the_same(layout, rows, module, where, max_tokens, times):
    """Out-of-memory errors from any module, in forward or backward, once, twice or every time above a size: the
    micro-batch's gradient equals the unsplit one (or a single row that cannot fit is reported, nothing raised)."""
    model = _shared_model()
    batch = packed(rows=min(rows, 2)) if layout == "packed" else padded(rows=rows)
    n = int((batch["labels"][:, 1:] != -100).sum())

    def forward(part):
        return model(**part, num_items_in_batch=n, use_cache=False).loss, {}

    model.zero_grad(set_to_none=True)
    forward(batch)[0].backward()
    reference = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    target = {"model": model, "layer0": model.model.layers[0], "layer1": model.model.layers[1], "head": model.lm_head}
    handle = OomInjector(max_tokens, where=where, times=times).install(target[module])
    try:
        splitter = OomSplitter()
        outcome = splitter.run(batch, forward, lambda loss: loss.backward(), model.parameters())
    finally:
        handle.remove()
    if outcome.failed is not None:
        assert split_batch_chain_ends_in_a_row_over(batch, max_tokens)
        return
    assert outcome.loss.detach().item() == pytest.approx(float(forward(batch)[0].detach()), rel=1e-5)
    assert worst_relative({k: p.grad for k, p in model.named_parameters()}, reference) <= TOL


def split_batch_chain_ends_in_a_row_over(batch, max_tokens):
    """Some part that cannot be cut further holds more than ``max_tokens`` tokens."""
    halves = split_batch(batch)
    if halves is None:
        return batch_tokens(batch) > max_tokens
    return any(split_batch_chain_ends_in_a_row_over(h, max_tokens) for h in halves)


@pytest.mark.slow
def test_pre_allocation_still_reports_what_does_not_fit(small_text_dataset, tokenizer, tmp_path):
    """CachePreallocator's trial step runs with splitting paused: it meets the error it exists to report, and its
    own backward of the worst batch runs (a detached loss would fail it)."""
    from lightning_seqmem import CachePreallocator, SeqMemDataModule
    from lightning_seqmem.memory.preallocate import PreallocationOOMError

    def fit(inject):
        dm = SeqMemDataModule(dataset=small_text_dataset, max_length=64, micro_batch_size=4, strategy="pack")
        torch.manual_seed(0)
        model = CausalLM(model_config=TINY, vocab_size=len(tokenizer), on_oom="split")
        if inject:
            OomInjector(128).install(model.model)
        trainer = L.Trainer(
            max_steps=1,
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            default_root_dir=tmp_path,
            callbacks=[CachePreallocator()],
        )
        trainer.fit(model, datamodule=dm)
        return model

    assert fit(False).oom_splits == 0
    with pytest.raises(PreallocationOOMError, match="rows=4, length=64"):
        fit(True)


@pytest.mark.slow
# a step the scaler skips (inf gradients) leaves the optimizer unstepped before the schedule's step: so says torch
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_the_grad_scaler_skips_the_same_steps_under_fp16():
    """16-mixed with a GradScaler (CPU autocast to fp16): a start scale that overflows the first steps' gradients,
    clipping on. The split run's parts are scaled as Lightning scales the step: the scaler skips the same steps
    (same final scale) and the weights agree within fp16's rounding of differently shaped matmuls."""
    from lightning.pytorch.plugins import MixedPrecision

    batches = [padded(rows=4, seed=s) for s in range(4)]

    def run(on_oom, inject):
        model = _model(on_oom=on_oom)
        if inject:
            OomInjector(40).install(model.model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30)
        _fit(model, batches, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], gradient_clip_val=0.5)
        return _weights(model), scaler.get_scale(), model.oom_splits

    reference, scale, _ = run("raise", False)
    weights, split_scale, splits = run("split", True)
    assert splits == 3 and split_scale == scale < 2.0**30  # 96 tokens, then 48 failed: quarters from then on
    assert worst_relative(weights, reference) <= 1e-3


def test_the_size_that_failed_survives_a_restart_and_full_shard_is_refused():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    model = _model(on_oom="split")
    model._oom.limit, model._oom.splits = 48, 3
    checkpoint = {}
    model.on_save_checkpoint(checkpoint)
    resumed = _model(on_oom="split")
    resumed.on_load_checkpoint(checkpoint)
    assert (resumed.oom_split_tokens, resumed.oom_splits) == (48, 3)
    resumed._trainer = SimpleNamespace(world_size=2, strategy=FSDPStrategy())
    with pytest.raises(ValueError, match="got FULL_SHARD: FULL_SHARD gathers them again inside the backward"):
        resumed._check_oom_strategy()  # FSDP's default sharding (tests/test_oom_split_fsdp.py: SHARD_GRAD_OP runs)
