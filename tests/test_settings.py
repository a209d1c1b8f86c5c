"""SeqMemDataModule's settings: one frozen object, checked once with today's messages, read by the strategies, the
planner and the resume signature; strategies built from it in setup and never changed afterwards."""

import dataclasses
import re
import types

import datasets
import numpy as np
import pytest

from lightning_seqmem import SeqMemDataModule
from lightning_seqmem.apps import planner
from lightning_seqmem.batching.options import Batching, Pack, Pad, Truncate
from lightning_seqmem.batching.settings import BatchingSettings
from lightning_seqmem.datamodule.settings import SeqMemSettings
from lightning_seqmem.kinds import PromptCompletion, Text
from lightning_seqmem.protocols import DescribesBatching

pytestmark = pytest.mark.filterwarnings("ignore:.*never reach the model.*", "ignore:.*no completion left.*")


def test_the_settings_are_frozen_and_built_once_from_the_arguments():
    dm = SeqMemDataModule(max_length=64, strategy="pack", num_workers=1)
    assert dm.settings == SeqMemSettings.from_arguments(max_length=64, strategy="pack", num_workers=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        dm.settings.batching.max_length = 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        dm.settings.data.num_workers = 4
    assert dm.hparams["max_length"] == 64 and dm.settings.batching.batching == Pack()
    # Each loader's options saved as plain values (loggers flatten them; checkpoints load them without classes).
    pack = {"strategy": "pack", "method": "bfd", "overflow": None, "allow_split_prompt_completion": False}
    assert dm.hparams["batching"] == dm.hparams["eval_batching"] == dict(pack, cu_seqlens=False)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_length=1), "max_length must be an int >= 2 (a row needs an input and a target), got 1."),
        (
            dict(strategy="bogus"),
            "Unknown strategy 'bogus'; choose one of ['pad', 'truncate', 'pack_bfd', 'pack_wrapped'] ('pack' is 'pack_bfd'), options in brackets ('pad(to_max_length=True)'), "
            "or pass an object: Pad(...), Truncate() or Pack(...).",
        ),
        (
            dict(eval_strategy="bogus"),
            "Unknown eval_strategy 'bogus'; choose one of ['pad', 'truncate', 'pack_bfd', 'pack_wrapped'] ('pack' is 'pack_bfd'), options in brackets "
            "('pad(to_max_length=True)'), or pass an object: Pad(...), Truncate() or Pack(...).",
        ),
        (
            dict(strategy="pack", max_length=32, max_tokens_per_batch=16),
            "max_tokens_per_batch=16 is smaller than one row of max_length=32 tokens (pack rows are always "
            "max_length long); set it to at least 32.",
        ),
        (
            dict(strategy="pad", eval_batching=Truncate(), max_length=32, max_tokens_per_batch=16),
            "max_tokens_per_batch=16 is smaller than one row of max_length=32 tokens (truncate rows are always "
            "max_length long); set it to at least 32.",
        ),
        (
            dict(batching=Pad(), strategy="pad"),
            "Give batching=Pad() or strategy='pad', not both: strategy is the shorthand for batching with its "
            "defaults (strategy='pad' is batching=Pad()).",
        ),
        (dict(eval_batch_size=0), "eval_batch_size must be an int >= 1 or None (= micro_batch_size), got 0."),
        (dict(num_workers=-1), "num_workers must be an int >= 0, got -1."),
        (
            dict(on_resume_mismatch="skip"),
            "on_resume_mismatch='skip' is not valid; use one of ('error', 'restart_epoch').",
        ),
        (
            dict(truncation_mode="keep_middle"),
            "truncation_mode='keep_middle' is not valid; use one of ('keep_start', 'keep_end').",
        ),
        (dict(train_on="user"), "train_on='user' is not valid; use one of ('assistant', 'last_assistant', 'all')."),
        (dict(on_empty_labels="skip"), "on_empty_labels='skip' is not valid; use one of ('drop', 'keep', 'error')."),
        (dict(streaming="false"), "streaming must be True or False, got 'false'."),  # "false" is truthy: would stream
        (dict(drop_last=1), "drop_last must be True or False, got 1."),
    ],
)
def test_bad_arguments_keep_their_messages(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        SeqMemDataModule(**kwargs)


def test_a_pad_budget_may_be_shorter_than_a_row():
    dm = SeqMemDataModule(strategy="pad", max_length=32, max_tokens_per_batch=16)  # rows vary: no refusal
    assert dm.settings.batching.max_tokens_per_batch == 16


def test_setup_does_not_change_the_strategies_or_the_settings(tokenizer):
    """Prompt/completion data resolve overflow to truncate: the pack strategy is built with it (full limits), once."""
    ds = datasets.Dataset.from_dict({"prompt": ["Question: what is two plus two?"] * 4, "completion": [" Four."] * 4})
    dm = SeqMemDataModule(
        dataset=datasets.DatasetDict(train=ds, validation=ds),
        tokenizer=tokenizer,
        max_length=16,
        strategy="pack",
        eval_strategy="pad",
        max_prompt_length=12,
    )
    before = dm.settings
    expected = PromptCompletion().strategy(before.batching, "train").prompt_completion_limits
    assert expected == before.batching.limits  # overflow=None on prompt/completion data: truncate, all limits
    assert Text().strategy(before.batching, "train").prompt_completion_limits.max_length is None  # split
    dm.setup("fit")
    train = dm.read_mode.strategies["train"]
    assert dm.settings is before and train.prompt_completion_limits == expected and train.overflow == "truncate"
    next(iter(dm.train_dataloader()))
    assert dm.read_mode.strategies["train"] is train and train.prompt_completion_limits == expected


@pytest.mark.parametrize(
    "kwargs, label, constant, packs",
    [
        (dict(strategy="pad"), "pad", False, False),
        (dict(batching=Pad(to_max_length=True)), "pad(to_max_length=True)", True, False),
        (dict(batching=Pad(to_max_length=True), max_tokens_per_batch=256), "pad(to_max_length=True)", False, False),
        (dict(strategy="truncate"), "truncate", True, False),
        (dict(batching=Pack(method="wrapped")), "pack_wrapped", True, True),
        (dict(batching=Pack(), eval_batching=Pad()), "pack_bfd", False, True),
        (dict(strategy="truncate", eval_strategy="pack"), "truncate", True, True),
    ],
)
def test_the_datamodule_describes_its_batching_through_its_strategies(
    small_text_dataset, kwargs, label, constant, packs
):
    dm = SeqMemDataModule(dataset=small_text_dataset, max_length=64, **kwargs)
    assert isinstance(dm, DescribesBatching)
    assert (dm.batching_label(), dm.constant_shapes(), dm.packs_documents()) == (label, constant, packs)


def test_the_planner_reads_the_datamodules_settings(small_text_dataset, monkeypatch):
    dm = SeqMemDataModule(dataset=small_text_dataset, max_length=64, micro_batch_size=4, strategy="pack")
    seen = {}

    def build_plan(lengths, strategies, max_lengths, settings, configured, *args):
        seen.update(settings=settings, configured=configured, strategies=strategies)
        return types.SimpleNamespace()  # a plan the caller adds to (a mix's sources)

    monkeypatch.setattr(planner, "build_plan", build_plan)
    planner.plan(dm)
    assert seen["settings"] is dm.settings.batching and seen["configured"] == (Pack(method="bfd"), 64)
    assert all(isinstance(s, Batching) for s in seen["strategies"])


def test_the_planner_compares_batching_objects_and_adds_the_configured_one():
    """The candidates are options objects (a name is its object, ``options.NAMES``), equal objects are one
    candidate, and a configuration that is none of them gets its own row, named in the same vocabulary."""
    assert planner.check_strategies(["pack", Pack(method="bfd"), Pad(), "pack_bfd"]) == (Pack(), Pad())
    with pytest.raises(ValueError, match="Unknown strategy 'pack_bdf'; choose one of .* Did you mean 'pack_bfd'"):
        planner.check_strategies(["pack_bdf"])
    lengths = {"train": np.arange(1, 60), "validation": np.arange(1, 9)}
    settings = BatchingSettings(micro_batch_size=4)
    own = Pad(to_multiple_of=32)
    result = planner.build_plan(lengths, [Pad(), Pack()], [16], settings, (own, 16))
    assert [p.strategy for p in result.strategies] == ["pad", "pack_bfd", "pad(to_multiple_of=32)"]
    assert result.configured.batching == own and result.configured.max_batch_shape == (4, 16)
    assert "pad(to_multiple_of=32)         16" in planner.format_plan(result)
    listed = planner.build_plan(lengths, [Pad(), Pack()], [16], settings, (Pack(method="bfd"), 16))
    assert len(listed.strategies) == 2 and listed.configured is listed.strategies[1]


def test_data_signature_keeps_its_key_names(small_text_dataset):
    """Checkpoints saved before the settings object compare equal: the same keys, overflow resolved (and the world
    size, which a rank's position depends on: a checkpoint without it is not compared on it)."""
    dm = SeqMemDataModule(dataset=small_text_dataset, max_length=64, strategy="pack")
    signature = dm.data_signature()
    assert set(signature) >= {  # and what later versions added (batching as written, kind, streaming, tokenizer)
        "strategy",
        "max_length",
        "micro_batch_size",
        "seed",
        "method",
        "overflow",
        "max_tokens_per_batch",
        "drop_last",
        "world_size",
        "train_rows",
        "train_lengths_crc32",
    }
    assert signature["overflow"] == "split" and signature["strategy"] == "pack"
