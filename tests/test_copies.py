"""What a user hands over survives ``pickle`` and ``copy.deepcopy`` (``ddp_spawn`` pickles the DataModule, loader
workers started by ``spawn`` pickle its dataset), and a ``Mix`` names its sources uniquely."""

from __future__ import annotations

import copy
import pickle

import datasets
import pytest
from test_read_matrix import _lists

from lightning_seqmem import Mix, Pack, Pad, SeqMemDataModule, Truncate
from lightning_seqmem.datamodule.settings import SeqMemSettings


def _texts(tag, n=30):
    return datasets.Dataset.from_dict({"text": [f"{tag} {i} " + "word " * (1 + i % 11) for i in range(n)]})


def _mix(**kw):
    return Mix(
        {"web": _texts("web"), "code": [f"def f{i}(): return {i}" for i in range(20)]}, {"web": 0.7, "code": 0.3}, **kw
    )


@pytest.mark.parametrize("copier", [pickle.loads.__name__, "deepcopy"])
def test_a_mix_survives_pickle_and_deepcopy(copier):
    mix = _mix(by="documents", exhausted="stop", seed=3)
    again = pickle.loads(pickle.dumps(mix)) if copier == "loads" else copy.deepcopy(mix)
    assert again == mix and again.weights == mix.weights and again.names == ("web", "code")
    assert again.by == "documents" and again.exhausted == "stop" and again.seed == 3
    with pytest.raises(AttributeError, match="Mix is frozen"):
        again.weights = (0.5, 0.5)


@pytest.mark.parametrize("value", [Pack(overflow="truncate"), Pad(to_multiple_of=16), Truncate()])
def test_option_classes_and_settings_survive_pickle_and_deepcopy(value):
    settings = SeqMemSettings.from_arguments(batching=value, max_length=64)
    for thing in (value, settings):
        assert pickle.loads(pickle.dumps(thing)) == thing and copy.deepcopy(thing) == thing


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("set_up", [False, True])
def test_a_datamodule_of_a_mix_survives_pickle_and_deepcopy(tmp_path, streaming, set_up):
    dm = SeqMemDataModule(
        dataset=_mix(),
        max_length=32,
        micro_batch_size=2,
        cache_dir=str(tmp_path),
        streaming=streaming,
        streaming_validation_documents=4,
    )
    if set_up:
        dm.setup("fit")
    batches = [_lists(b) for _, b in zip(range(3), dm.train_dataloader())]
    for again in (pickle.loads(pickle.dumps(dm)), copy.deepcopy(dm)):
        assert again.dataset == dm.dataset
        assert [_lists(b) for _, b in zip(range(3), again.train_dataloader())] == batches


def test_source_names_must_be_unique_once_named_and_a_source_is_no_mix():
    with pytest.raises(ValueError, match=r"Mix sources 1 and '1' are both named '1'"):
        Mix({1: _texts("a"), "1": _texts("b")}, {1: 0.9, "1": 0.1})
    with pytest.raises(ValueError, match=r"Mix source 'inner' is itself a Mix"):
        Mix({"inner": _mix(), "b": _texts("b")})


@pytest.mark.parametrize("streaming", [False, True])
def test_a_datamodule_says_whether_it_streams_for_one_source_or_a_mix(streaming, tmp_path):
    for data in (_texts("one"), _mix()):
        dm = SeqMemDataModule(
            dataset=data, max_length=32, cache_dir=str(tmp_path), streaming=streaming, streaming_validation_documents=4
        )
        assert dm.streaming is streaming  # before setup (ConfigChecks may ask first) and after
        dm.setup("fit")
        assert dm.streaming is streaming


@pytest.mark.slow
def test_a_mix_serves_loader_workers_started_by_spawn(tmp_path):
    """Loader workers started by ``spawn`` (as on macOS, or under ``ddp_spawn``) get the mix pickled."""
    dm = SeqMemDataModule(dataset=_mix(), max_length=32, micro_batch_size=2, cache_dir=str(tmp_path), num_proc=1)
    expected = [_lists(b) for b in dm.train_dataloader()]
    dm = SeqMemDataModule(
        dataset=_mix(), max_length=32, micro_batch_size=2, cache_dir=str(tmp_path), num_proc=1, num_workers=2
    )
    loader = dm.train_dataloader()
    loader.multiprocessing_context = "spawn"
    assert [_lists(b) for b in loader] == expected


# A Mix under Lightning's real ddp_spawn (pickled into each rank's fresh interpreter): test_sweep's
# test_ddp_spawn_job_inside_a_multirun trains data=mix that way, one spawn run for both claims.
