"""Each strategy holds its own options (Pad, Truncate, Pack): checked once where declared, refused with their name on
the wrong strategy, built into the strategy objects, saved as plain values, and part of the resume signature."""

import re

import pytest
import yaml

from lightning_seqmem import SeqMemDataModule
from lightning_seqmem.batching.options import STRATEGIES, Pack, Pad, Truncate, as_batching
from lightning_seqmem.batching.settings import BatchingSettings
from lightning_seqmem.batching.strategies import make_strategy
from lightning_seqmem.datamodule.resume import check_signature
from lightning_seqmem.kinds import PromptCompletion

pytestmark = pytest.mark.filterwarnings("ignore:.*never reach the model.*")

OPTIONS = {Pad: ("to_multiple_of", "to_max_length", "group_by_length"), Truncate: ()}
OPTIONS[Pack] = ("method", "overflow", "allow_split_prompt_completion", "cu_seqlens")
OWNER = {option: cls for cls, options in OPTIONS.items() for option in options}


@pytest.mark.parametrize(
    "cls, option", [(cls, option) for cls in OPTIONS for option in OWNER if option not in OPTIONS[cls]]
)
def test_an_option_given_to_the_wrong_strategy_is_refused_with_its_name_and_its_owner(cls, option):
    owner = OWNER[option].__name__
    mine = ", ".join(OPTIONS[cls]) or "none"
    message = (
        f"{cls.__name__} has no option {option!r}: it is an option of {owner} (e.g. batching={owner}({option}=...)). "
        f"{cls.__name__}'s options: {mine}."
    )
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        cls(**{option: OWNER[option]().__getattribute__(option)})


def test_the_old_flat_flags_are_gone_from_the_datamodule():
    for flag in ("packing", "overflow", "group_by_length", "pad_to_max_length", "return_cu_seqlens"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{flag}'"):
            SeqMemDataModule(**{flag: None})
    with pytest.raises(TypeError, match="^Pack has no option 'packing'. Pack's options: method, overflow"):
        Pack(packing="bfd")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Pack(method="ffd"), "Pack(method='ffd') is not valid; use one of ('bfd', 'wrapped')."),
        (
            lambda: Pack(overflow="wrap"),
            "Pack(overflow='wrap') is not valid; use one of ('split', 'truncate', 'drop', 'error') (or None).",
        ),
        (lambda: Pack(cu_seqlens=1), "cu_seqlens must be True or False, got 1."),
        (
            lambda: Pack(allow_split_prompt_completion=True),
            "Pack(allow_split_prompt_completion=True) only applies to overflow='split' (got overflow=None); set "
            "overflow='split' too, or leave allow_split_prompt_completion out.",
        ),
        (lambda: Pad(to_multiple_of=0), "to_multiple_of must be an int >= 1 or None, got 0."),
        (lambda: Pad(to_max_length="yes"), "to_max_length must be True or False, got 'yes'."),
        (lambda: Pad(group_by_length=None), "group_by_length must be True or False, got None."),
    ],
)
def test_a_bad_value_is_refused_where_it_is_declared(make, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        make()


def test_shorthands_are_the_defaults_and_objects_compare_by_value():
    assert STRATEGIES == ("pad", "truncate", "pack")
    assert [as_batching(name) for name in STRATEGIES] == [Pad(), Truncate(), Pack()]
    assert SeqMemDataModule(strategy="truncate", eval_strategy="pack").settings.batching.eval_batching == Pack()
    assert SeqMemDataModule().settings.batching.batching == Pack()  # neither given: pack, as the main job
    assert Pack(method="bfd") == Pack() and len({Pack(), Pack(method="bfd"), Pad()}) == 2
    assert repr(Pack(overflow="drop")) == "Pack(method='bfd', overflow='drop')" and repr(Truncate()) == "Truncate()"
    assert (Pad.packs, Truncate.full_length_rows, Pack.packs) == (False, True, True)


def test_the_strategy_objects_are_built_from_the_options():
    pad = make_strategy(BatchingSettings(max_length=64, batching=Pad(to_multiple_of=16)))
    assert pad.padded_length(17) == 32 and pad.options == Pad(to_multiple_of=16) and not pad.constant_shapes
    assert make_strategy(BatchingSettings(batching=Pad(to_max_length=True))).constant_shapes
    pack = PromptCompletion().strategy(BatchingSettings(batching=Pack(cu_seqlens=True)), "train")
    assert "cu_seqlens" in pack.keys and pack.overflow == "truncate" and pack.label == "pack_bfd(cu_seqlens=True)"
    settings = BatchingSettings(batching=Pack(method="wrapped"), eval_batching=Truncate())
    assert [make_strategy(settings, split).label for split in ("train", "validation")] == ["pack_wrapped", "truncate"]


def test_the_options_are_saved_as_plain_values_that_build_the_same_datamodule():
    dm = SeqMemDataModule(batching=Pad(group_by_length=True), eval_batching=Truncate())
    assert dm.hparams["eval_batching"] == {"strategy": "truncate"}
    again = SeqMemDataModule(**dm.hparams).settings.batching  # as LightningDataModule.load_from_checkpoint does
    assert (again.batching, again.eval_batching) == (Pad(group_by_length=True), Truncate())
    assert as_batching(Pack(overflow="drop").as_dict()) == Pack(overflow="drop")
    assert yaml.safe_load(yaml.safe_dump(dict(dm.hparams)))["batching"] == {
        "strategy": "pad",
        "to_multiple_of": 8,
        "to_max_length": False,
        "group_by_length": True,
    }


def test_the_resume_signature_matches_the_same_options_and_names_a_changed_one(small_text_dataset):
    def signature(**kwargs):
        dm = SeqMemDataModule(dataset=small_text_dataset, max_length=64, micro_batch_size=4, **kwargs)
        return dm.data_signature()

    saved = signature(batching=Pack(method="bfd"))
    assert saved == signature(strategy="pack") == signature(batching=Pack(overflow="split", cu_seqlens=True))
    assert not check_signature(saved, signature(strategy="pack"), "error", print)
    with pytest.raises(ValueError, match="method: 'bfd' -> 'wrapped'"):
        check_signature(saved, signature(batching=Pack(method="wrapped")), "error", print)
    grouped = signature(batching=Pad(group_by_length=True))
    assert grouped["strategy"] == "pad" and grouped["group_by_length"] and "method" not in grouped
    with pytest.raises(ValueError, match="group_by_length: True -> False"):
        check_signature(grouped, signature(batching=Pad()), "error", print)
