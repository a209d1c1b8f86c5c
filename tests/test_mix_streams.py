"""A ``Mix`` of streams (``streaming=True``): the share in every prefix of the batches, with and without loader
workers, stop and repeat, and validation per source."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_mix_datamodule import MAX, _docs, _source_tokens

from lightning_seqmem import Mix, SeqMemDataModule
from lightning_seqmem.batch import SOURCE_INDEX
from lightning_seqmem.streams.mixed import MixedRows, row_tokens


def _stream_dm(exhausted="repeat", **kw):
    mix = Mix(_docs(), {"long": 0.3, "short": 0.7}, exhausted=exhausted)
    args = {"max_length": MAX, "micro_batch_size": 4, "pad_token_id": 0, "streaming": True}
    return SeqMemDataModule(dataset=mix, streaming_validation_documents=10, **args, **kw)


def _gaps(loader):
    served, worst, rows = np.zeros(2), 0.0, []
    for batch in loader:
        served += _source_tokens(batch)
        worst = max(worst, np.abs(np.asarray([0.3, 0.7]) * served.sum() - served).max())
        rows += [tuple(x for x in row if x) for row in batch["input_ids"].tolist()]
    return worst, served, rows


@pytest.mark.parametrize("exhausted", ["stop", "repeat"])
def test_a_mix_of_streams_holds_the_share_in_every_prefix(exhausted):
    dm = _stream_dm(exhausted)
    worst, served, rows = _gaps(dm.train_dataloader())
    assert worst <= MAX and served.min() > 0
    state = dm.read_mode.mixed.last_state
    if exhausted == "stop":
        assert len(set(rows)) == len(rows) and 1 in state["passes"]  # one source ended: nothing read twice
    else:
        assert min(state["passes"]) >= 1 and max(state["passes"]) > 1  # the short source repeated
    assert dm.stats()["train"]["sources"]["long"]["weight"] == 0.3


def test_with_loader_workers_every_prefix_is_within_one_row_per_worker():
    worst, served, _ = _gaps(_stream_dm(num_workers=2).train_dataloader())
    assert worst <= 2 * MAX and served.min() > 0


def test_stream_validation_batches_say_their_source():
    dm = _stream_dm()
    sources = [int(b[SOURCE_INDEX][0]) for b in dm.val_dataloader()]
    assert sorted(set(sources)) == [0, 1] and sources[:2] == [0, 1]  # the sources take turns


def test_mixed_rows_of_plain_iterables_stop_and_repeat():
    a = [{"input_ids": [1] * 30, "seq_lengths": [30]}] * 5  # 150 tokens
    b = [{"input_ids": [2] * 3, "seq_lengths": [3]}] * 10  # 30 tokens
    stop = list(MixedRows([a, b], [0.5, 0.5], "stop", row_tokens))
    assert sum(r["input_ids"][0] == 2 for r in stop) == 10  # b runs out first: the rows end there
    repeat = MixedRows([a, b], [0.5, 0.5], "repeat", row_tokens)
    rows = list(repeat)
    # the rows end as soon as a has ended once (b was read 4 times over by then), each share within one row
    assert repeat.last_state["passes"] == [1, 4]
    b_tokens = 3 * sum(r["input_ids"][0] == 2 for r in rows)
    assert abs(b_tokens - 0.5 * (150 + b_tokens)) <= 30
    assert list(MixedRows([a, []], [0.5, 0.5], "repeat")) == []  # an empty source cannot repeat forever


def _stream_rank(rank):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        dm = _stream_dm()
        loader = iter(dm.train_dataloader())  # under DDP a stream repeats on every rank: take a fixed number
        batches = [next(loader) for _ in range(30)]
        worst, served, _ = _gaps(batches)
        val = [int(b[SOURCE_INDEX][0]) for b in dm.val_dataloader()]
        return {"worst": worst, "served": served.tolist(), "val": val}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_each_hold_the_share_of_a_mix_of_streams():
    from _forked_ranks import run_ranks

    r0, r1 = run_ranks(_stream_rank)
    assert r0["worst"] <= MAX and r1["worst"] <= MAX and min(r0["served"] + r1["served"]) > 0
    assert r0["val"] == r1["val"] and sorted(set(r0["val"])) == [0, 1]  # the same turns: no rank waits


def _rows(batches):
    return [{k: v.tolist() for k, v in b.items()} for b in batches]


_FULL: dict[str, list] = {}


@pytest.mark.slow
@settings(max_examples=6, deadline=None)
@given(cut=st.integers(0, 30), exhausted=st.sampled_from(["stop", "repeat"]))
def test_a_mix_of_streams_cut_anywhere_goes_on_with_the_same_batches(cut, exhausted):
    """The mixer's counts, each source's row read ahead and each source's reader state come back."""
    if exhausted not in _FULL:  # the uninterrupted epoch, read once for every example that draws it
        _FULL[exhausted] = _rows(_stream_dm(exhausted).train_dataloader())
    full = _FULL[exhausted]
    loader = _stream_dm(exhausted).train_dataloader()
    it = iter(loader)
    head = _rows(next(it) for _ in range(min(cut, len(full))))
    again = _stream_dm(exhausted).train_dataloader()
    again.load_state_dict(loader.state_dict())
    assert head + _rows(again) == full


@pytest.mark.slow
def test_a_mix_of_streams_with_workers_resumes_through_a_checkpoint_and_refuses_other_workers(tmp_path):
    from test_stream_resume import _Batches, _fit

    full, _ = _fit(_stream_dm(num_workers=2), 8, tmp_path / "full", save=True, model=_Batches())
    ckpt = str(tmp_path / "full" / "epoch=0-step=3.ckpt")
    resumed, _ = _fit(_stream_dm(num_workers=2), 8, tmp_path / "resumed", ckpt=ckpt, model=_Batches())
    assert resumed.seen == full.seen[3:]
    with pytest.raises(ValueError, match=r"mix of streams with 1 loader worker.*num_workers=2.*restart_epoch"):
        _fit(_stream_dm(num_workers=1), 8, tmp_path / "other", ckpt=ckpt, model=_Batches())
    with pytest.raises(ValueError, match=r"weights.*on_resume_mismatch='restart_epoch'"):
        other = Mix(_docs(), {"long": 0.5, "short": 0.5})
        dm = SeqMemDataModule(
            dataset=other,
            max_length=MAX,
            micro_batch_size=4,
            pad_token_id=0,
            streaming=True,
            num_workers=2,
            streaming_validation_documents=10,
        )
        _fit(dm, 8, tmp_path / "weights", ckpt=ckpt, model=_Batches())
