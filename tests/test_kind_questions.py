"""Data kinds are asked, never compared by name, outside the module that defines them (issue 29 item 1), and the
advice a user reads names the batching options (``batching=Pack(overflow='split')``) in both read modes."""

import pathlib
import re

import datasets
import pytest

import lightning_seqmem
from lightning_seqmem import SeqMemDataModule
from lightning_seqmem.batching.options import Pack, Pad
from lightning_seqmem.batching.settings import BatchingSettings
from lightning_seqmem.kinds import Conversations, Preference, PromptCompletion, Text

PACKAGE = pathlib.Path(lightning_seqmem.__file__).parent
NAMES = r"(prompt_completion|conversations|preference)(_tokens)?"  # "text" also names a chat content part's type
COMPARED = re.compile(
    rf"(==|!=|\bin\b)\s*\(?\s*[\"']{NAMES}[\"']"  # kind == "preference", kind in ("conversations", ...)
    rf"|[\"']{NAMES}[\"']\s*(==|!=)"  # "preference" == kind
    r"|\w*kind\w*(\(\))?(\[\d\])?\.(name|column_kind)\s*(==|!=|in\b|not in\b)"  # kind.name == "text"
    r"|tokenized_documents\(\)\[1\]\.name"  # the kind's name taken to compare
    r"|\b(PREFERENCE|PLANNED_KINDS|PRETOKENIZED_KINDS)\b"  # the old name constants
)


def test_no_kind_is_compared_by_name_outside_kinds():
    found = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if "kinds" not in path.relative_to(PACKAGE).parts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if COMPARED.search(line)
    ]
    assert not found, "ask the kind object instead:\n" + "\n".join(found)


def test_each_kind_answers_the_questions_batching_and_the_planner_ask():
    settings = BatchingSettings(max_length=16, max_prompt_length=15, batching=Pack())
    assert [k.strategy(settings, "train").overflow for k in (Text(), PromptCompletion(), Conversations())] == [
        "split",
        "truncate",
        "truncate",
    ]
    assert Preference().strategy(settings, "train").label == "pack_bfd (pairs)"
    assert (Text().planned, PromptCompletion().planned, Conversations().planned, Preference().planned) == (
        True,
        False,
        True,
        True,
    )
    assert Preference().leaves_room(settings, 16) and not Preference().leaves_room(settings, 15)
    assert Text().leaves_room(settings, 2)
    with pytest.raises(ValueError, match=r"Pack\(method='wrapped'\) cuts rows"):
        Conversations().check(BatchingSettings(batching=Pad(), eval_batching=Pack(method="wrapped")))
    Preference().check(BatchingSettings(batching=Pack(method="wrapped")))  # pairs are always packed whole
    with pytest.raises(ValueError, match=r"batching=Pack\(overflow='split', allow_split_prompt_completion=True\)"):
        PromptCompletion().check(BatchingSettings(batching=Pack(overflow="split")))


ADVICE = r"use batching=Pack\(overflow='split'\), Pack\(overflow='truncate'\) or Pack\(overflow='drop'\)"


def test_a_document_over_max_length_is_refused_with_the_same_advice_in_both_read_modes(small_text_dataset):
    batching = Pack(overflow="error")
    with pytest.raises(ValueError, match=rf"tokens > max_length=40 .*{ADVICE}"):
        SeqMemDataModule(dataset=small_text_dataset, max_length=40, batching=batching).setup("fit")
    texts = list(small_text_dataset["text"])
    stream = datasets.IterableDataset.from_generator(lambda: ({"text": t} for t in texts))
    dm = SeqMemDataModule(dataset=stream, max_length=40, batching=batching, streaming_validation_documents=2)
    dm.setup("fit")
    with pytest.raises(ValueError, match=rf"document at row \d+ has \d+ tokens > max_length=40; {ADVICE}"):
        list(dm.train_dataloader())
