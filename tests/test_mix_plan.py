"""``seqmem-plan`` on a ``Mix``: planned on the documents its epoch reads, each source described, mixed kinds
refused by name."""

import pytest
from test_mix_datamodule import _docs
from test_plan_app import _compose

from lightning_seqmem import Mix, SeqMemDataModule
from lightning_seqmem.apps.plan_app import plan_from_config
from lightning_seqmem.apps.plan_mix import mix_sample
from lightning_seqmem.apps.planner import plan


def _dm(exhausted="repeat"):
    mix = Mix(_docs(), {"long": 0.3, "short": 0.7}, exhausted=exhausted)
    return SeqMemDataModule(dataset=mix, max_length=32, micro_batch_size=4, pad_token_id=0)


@pytest.mark.parametrize("exhausted", ["repeat", "stop"])
def test_a_mix_is_planned_on_the_documents_its_epoch_reads(exhausted):
    copy, notes = mix_sample(_dm(exhausted))
    ids = copy.tokenized_documents()[0]["train"]["input_ids"]
    tokens = [sum(len(x) for x in ids if x[0] < 100), sum(len(x) for x in ids if x[0] >= 100)]
    one_document = max(len(x) for x in ids) / sum(tokens)  # a part of a pass is whole documents
    assert tokens[0] / sum(tokens) == pytest.approx(0.3, abs=one_document)  # the weights, by tokens
    read = {"repeat": "'short' read 4.", "stop": "'long' read 0."}[exhausted]  # short repeats / long is cut short
    assert any(read in n for n in notes) and any("mix source 'long' (weight 0.3)" in n for n in notes)
    result = plan(_dm(exhausted))
    assert result.distribution["tokens"] == sum(tokens)


def test_seqmem_plan_refuses_a_mix_of_two_kinds_by_name():
    cfg = _compose("plan", ["data=mix", "plan.memory=false", "plan.max_lengths=[64]"])
    with pytest.raises(ValueError, match="one data kind; its sources hold 'prose': text, 'chat': conversations"):
        plan_from_config(cfg)
