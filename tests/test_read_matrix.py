"""The 2 x 2 of read paths (one source or a ``Mix``, map-style or streamed) through save and resume, in one table.

Each row saves the DataModule's state and its train loader's position after a few batches, builds the DataModule
again with one setting changed, and resumes: unchanged gives the uninterrupted run's next batches bit for bit; a
setting that decides the rows is refused with a message that names it in the user's words (or, with
``on_resume_mismatch="restart_epoch"``, the epoch starts afresh); what resumes elastically (docs/resuming.md) does.
Cuts at batches hypothesis draws resume exactly too, in one process and on two gloo ranks with two loader workers
each.
"""

from __future__ import annotations

import copy

import datasets
import pytest
import torch
from _quick_script import quick

from lightning_seqmem import Mix, Pack, SeqMemDataModule
from lightning_seqmem.data.tokenizer import load_tokenizer

CUT = 3  # batches read before the checkpoint
MODES = [("map", "one"), ("map", "mix"), ("stream", "one"), ("stream", "mix")]


def _texts(tag: str, n: int = 40, first: int = 0) -> datasets.Dataset:
    texts = [f"{tag} document {i}: " + "lorem ipsum dolor sit amet " * (1 + (i * 5) % 9) for i in range(first, n)]
    return datasets.Dataset.from_dict({"text": texts})


def _data(sources: str, dataset: str = "same", weights=None):
    web = _texts("web", first=1 if dataset == "other" else 0)
    if sources == "one":
        return web
    return Mix({"web": web, "code": _texts("code", 30)}, weights or {"web": 0.7, "code": 0.3})


_TOKENIZERS: dict[str, object] = {}


def _tokenizer(which: str):
    """The built-in tokenizer, or a copy with one more token (another tokenizer that cuts these texts alike)."""
    if which not in _TOKENIZERS:
        tok = load_tokenizer()
        if which == "other":
            tok = copy.deepcopy(tok)
            tok.add_tokens(["zzqxv"])
        _TOKENIZERS[which] = tok
    return _TOKENIZERS[which]


def _dm(read: str, sources: str, cache, dataset="same", tokenizer="same", weights=None, **kw) -> SeqMemDataModule:
    args = dict(max_length=32, micro_batch_size=2, batching=Pack(), cache_dir=str(cache), num_proc=1)
    args.update(streaming=read == "stream", streaming_validation_documents=4, streaming_buffer_size=8)
    return SeqMemDataModule(dataset=_data(sources, dataset, weights), tokenizer=_tokenizer(tokenizer), **{**args, **kw})


def _lists(batch) -> dict:
    return {k: v.tolist() for k, v in batch.items()}


def _save(read, sources, cache, **kw):
    """``(state of the DataModule, loader position, the CUT batches read, the uninterrupted run's next 3)``."""
    full = [_lists(b) for _, b in zip(range(CUT + 3), _dm(read, sources, cache, **kw).train_dataloader())]
    dm = _dm(read, sources, cache, **kw)
    loader = dm.train_dataloader()
    it = iter(loader)
    head = [_lists(next(it)) for _ in range(CUT)]
    assert head == full[:CUT]
    return copy.deepcopy(dm.state_dict()), copy.deepcopy(loader.state_dict()), full[CUT:]


def _resume(read, sources, cache, saved, **kw):
    dm_state, loader_state, _ = saved
    dm = _dm(read, sources, cache, **kw)
    dm.load_state_dict(copy.deepcopy(dm_state))
    loader = dm.train_dataloader()
    loader.load_state_dict(copy.deepcopy(loader_state))
    return [_lists(b) for _, b in zip(range(3), loader)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("token_cache")


@pytest.fixture(scope="module")
def saved(cache):
    return {(r, s): _save(r, s, cache) for r, s in MODES}


# setting changed -> (the resumed DataModule's arguments, what the message names) for every mode where it applies
REFUSED = {
    "dataset": (dict(dataset="other"), r"dataset"),
    "tokenizer": (dict(tokenizer="other"), r"tokenizer: changed"),
    "max_length": (dict(max_length=24), r"max_length: 32 -> 24"),
    "batching": (
        dict(batching=Pack(overflow="truncate")),
        r"batching: Pack\(method='bfd', overflow='split'\) -> Pack\(method='bfd', overflow='truncate'\)",
    ),
    "weights": (dict(weights={"web": 0.5, "code": 0.5}), r"weights: \{'web': 0.7, 'code': 0.3\} -> \{'web': 0.5"),
}


@pytest.mark.parametrize("read,sources", MODES)
def test_unchanged_settings_resume_with_the_next_batches(read, sources, cache, saved, tmp_path):
    """Through a file loaded with ``weights_only=True`` (plain values: the typed reader states are saved as dicts)."""
    dm_state, loader_state, following = saved[(read, sources)]
    torch.save({"dm": dm_state, "loader": loader_state}, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert _resume(read, sources, cache, (loaded["dm"], loaded["loader"], following)) == following


@pytest.mark.parametrize("setting", sorted(REFUSED))
@pytest.mark.parametrize("read,sources", MODES)
def test_a_setting_that_decides_the_rows_is_refused_by_name(read, sources, setting, cache, saved):
    if setting == "weights" and sources == "one":
        pytest.skip("a single source has no weights")
    changes, named = REFUSED[setting]
    with pytest.raises(ValueError, match=named) as error:
        _resume(read, sources, cache, saved[(read, sources)], **changes)
    assert "on_resume_mismatch='restart_epoch'" in str(error.value)


@pytest.mark.parametrize("read,sources", MODES)
def test_a_checkpoint_read_the_other_way_is_refused_naming_streaming(read, sources, cache, saved):
    other = "map" if read == "stream" else "stream"
    with pytest.raises(ValueError, match=rf"streaming: {read == 'stream'} -> {other == 'stream'}"):
        _resume(other, sources, cache, saved[(read, sources)])


@pytest.mark.parametrize("read,sources", MODES)
def test_another_world_size(read, sources, cache, saved):
    """A map-style position is every ``world``-th batch of the epoch: refused by name. A single stream's readers are
    dealt to the new ranks (docs/resuming.md), a mix of streams is refused by its loader: both not by the signature."""
    dm_state, loader_state, following = saved[(read, sources)]
    faked = (dict(dm_state, data_signature=dict(dm_state["data_signature"], world_size=2)), loader_state, following)
    if read == "map":
        with pytest.raises(ValueError, match=r"world_size: 2 -> 1"):
            _resume(read, sources, cache, faked)
        fresh = [_lists(b) for _, b in zip(range(3), _dm(read, sources, cache).train_dataloader())]
        with pytest.warns(UserWarning, match=r"world_size: 2 -> 1.*restarts from its first batch"):
            assert _resume(read, sources, cache, faked, on_resume_mismatch="restart_epoch") == fresh
    else:
        assert _resume(read, sources, cache, faked) == following


@pytest.mark.parametrize("read,sources", MODES)
def test_restart_epoch_starts_the_changed_rows_from_their_first_batch(read, sources, cache, saved):
    fresh = [_lists(b) for _, b in zip(range(3), _dm(read, sources, cache, max_length=24).train_dataloader())]
    with pytest.warns(UserWarning, match="max_length: 32 -> 24.*restarts from its first batch"):
        resumed = _resume(
            read, sources, cache, saved[(read, sources)], max_length=24, on_resume_mismatch="restart_epoch"
        )
    assert resumed == fresh


@pytest.mark.slow
@pytest.mark.parametrize("read,sources", MODES)
def test_another_number_of_loader_workers(read, sources, cache, saved):
    """Map-style batches are the sampler's (any worker count goes on exactly); a single stream's readers are
    regrouped; a mix of streams (its order decided per reader) is refused naming ``num_workers``."""
    state = saved[(read, sources)]
    if read == "stream" and sources == "mix":
        with pytest.raises(ValueError, match=r"num_workers=0"):
            _resume(read, sources, cache, state, num_workers=2)
    elif read == "map":
        assert _resume(read, sources, cache, state, num_workers=2) == state[2]
    else:
        resumed = _resume(read, sources, cache, state, num_workers=2)
        assert len(resumed) == 3 and all(len(b["input_ids"][0]) == 32 for b in resumed)


@pytest.mark.slow
def test_a_fresh_process_resumes_with_the_next_batches(cache, saved, tmp_path):
    """The normal case after a preemption: the checkpoint read back by a new interpreter, its tokenizer loaded anew
    (the fingerprint is of what the encoders use, not of the backend's padding and truncation of the moment). One
    interpreter for a stream, a mix of streams and a map-style mix (its imports cost more than the resumes)."""
    import json
    import os
    import subprocess
    import sys

    cases = [("stream", "one"), ("stream", "mix"), ("map", "mix")]
    torch.save({f"{r}-{s}": saved[(r, s)][:2] for r, s in cases}, tmp_path / "state.pt")
    code = (
        f"import json, sys, torch; sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from test_read_matrix import _resume\n"
        f"state = torch.load({str(tmp_path / 'state.pt')!r}, weights_only=True)\n"
        f"print(json.dumps([_resume(r, s, {str(cache)!r}, (*state[f'{{r}}-{{s}}'], None)) for r, s in {cases!r}]))\n"
    )
    out = subprocess.run([sys.executable, "-c", quick(code)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [saved[case][2] for case in cases]


_FULL: dict[tuple[str, str], list] = {}  # per mode: the uninterrupted run's first 12 batches, read once


@pytest.mark.slow
@pytest.mark.parametrize("read,sources", MODES)
def test_a_cut_anywhere_resumes_with_the_next_batches(read, sources, cache):
    """The same table, cut at batches hypothesis draws (not one hand-picked step): every later batch is the
    uninterrupted run's, for one source and a ``Mix``, map-style and streamed alike."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    if (read, sources) not in _FULL:
        _FULL[(read, sources)] = [_lists(b) for _, b in zip(range(12), _dm(read, sources, cache).train_dataloader())]
    full = _FULL[(read, sources)]

    @settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(cut=st.integers(0, 9))
    def cut_and_resume(cut):
        dm = _dm(read, sources, cache)
        loader = dm.train_dataloader()
        it = iter(loader)
        assert [_lists(next(it)) for _ in range(cut)] == full[:cut]
        state = (copy.deepcopy(dm.state_dict()), copy.deepcopy(loader.state_dict()), None)
        resumed = _resume(read, sources, cache, state)
        assert resumed == full[cut : cut + 3]

    cut_and_resume()


def _cut_on_a_rank(rank, read, sources, cache, cuts, batches):
    """One of two gloo ranks, two loader workers each: for each cut, the DataModule's state and the loader's
    (gathered over the ranks) into fresh ones, and every later batch compared with the uninterrupted run's."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        full = [_lists(b) for _, b in zip(range(batches), _dm(read, sources, cache, num_workers=2).train_dataloader())]
        for cut in cuts:
            dm = _dm(read, sources, cache, num_workers=2)
            loader = dm.train_dataloader()
            it = iter(loader)
            head = [_lists(next(it)) for _ in range(cut)]
            saved = (copy.deepcopy(dm.state_dict()), copy.deepcopy(loader.state_dict()))
            del it, loader  # its workers stop before the resumed loader starts its own
            again = _dm(read, sources, cache, num_workers=2)
            again.load_state_dict(saved[0])
            resumed = again.train_dataloader()
            resumed.load_state_dict(saved[1])
            assert head + [_lists(b) for _, b in zip(range(batches - cut), resumed)] == full, cut
        return len(full)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("read,sources", MODES)
def test_two_ranks_with_two_workers_each_cut_anywhere_resume_with_the_next_batches(read, sources, cache):
    """Workers x ranks for each of the four read paths: two forked gloo ranks, two loader workers each, cut at
    batches hypothesis draws; every later batch on each rank is the uninterrupted run's."""
    from _forked_ranks import run_ranks
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    _dm(read, sources, cache).prepare_data()  # the token cache once, here, not on both ranks at once

    @settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(cuts=st.lists(st.integers(0, 6), min_size=2, max_size=2, unique=True))
    def cut_and_resume(cuts):
        assert run_ranks(_cut_on_a_rank, read, sources, cache, cuts, 7, timeout=300) == [7, 7]

    cut_and_resume()
