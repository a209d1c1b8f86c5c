"""``seqmem-plan`` on preference pairs: the planner's numbers are the DataModule's (``stats()``,
``max_batch_shape()``) for padded and packed pairs, and its memory table sizes 2B rows for padded pairs."""

import datasets
import numpy as np
import pytest

from lightning_seqmem import SeqMemDataModule
from lightning_seqmem.apps.planner import format_plan, plan
from lightning_seqmem.training.building import build_model_config


def pairs(n=80, seed=0):
    rng = np.random.default_rng(seed)
    draw = lambda median, sigma: max(1, int(rng.lognormal(np.log(median), sigma)))  # noqa: E731
    return [
        {
            "prompt_ids": rng.integers(3, 60, draw(12, 0.7)).tolist(),
            "chosen_ids": rng.integers(3, 60, draw(20, 0.8)).tolist(),
            "rejected_ids": rng.integers(3, 60, draw(16, 0.8)).tolist(),
        }
        for _ in range(n)
    ]


@pytest.mark.parametrize("strategy,name", [("pad", "pad"), ("truncate", "truncate"), ("pack", "pack")])
def test_the_plan_of_pairs_is_what_the_datamodule_reports(tmp_path, strategy, name):
    rows = pairs()
    data = datasets.DatasetDict(train=datasets.Dataset.from_list(rows), validation=datasets.Dataset.from_list(rows[:8]))
    arguments = dict(max_length=48, max_prompt_length=16, micro_batch_size=4, pad_token_id=0, cache_dir=tmp_path)
    config = build_model_config(
        dict(
            model_type="llama",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
        64,
        0,
    )
    result = plan(
        SeqMemDataModule(data, strategy=strategy, **arguments),
        config,
        strategies=[name],
        max_lengths=[48],
        micro_batch_sizes=[4],
        device="cpu",
        precision="32-true",
    )
    dm = SeqMemDataModule(data, strategy=strategy, **arguments)
    dm.setup("fit")
    stats, mine = dm.stats()["train"], result.configured
    assert (mine.token_efficiency, mine.rows, mine.batches) == (
        stats["token_efficiency"],
        stats["rows"],
        stats["batches"],
    )
    assert mine.tokens == stats["tokens"] and mine.tokens_lost == stats["tokens_truncated"] + stats["tokens_dropped"]
    assert mine.max_batch_shape == dm.max_batch_shape()
    estimate = result.memory.estimates[False][4]  # micro_batch_size 4 is 8 rows of padded pairs, 4 packed rows
    assert (estimate.rows, estimate.length) == dm.max_batch_shape()
    assert "wrapped" not in format_plan(result)


def test_dpo_reference_copy_adds_its_weights_to_the_plan(tmp_path):
    """DPO's frozen copy keeps a second set of weights resident for the whole step: the planner adds exactly the
    policy's parameter bytes (the copy's no-grad forward frees its activations before the policy's peak)."""
    rows = pairs(24)
    data = datasets.DatasetDict(train=datasets.Dataset.from_list(rows), validation=datasets.Dataset.from_list(rows[:8]))
    config = build_model_config(
        dict(
            model_type="llama",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
        64,
        0,
    )
    results = [
        plan(
            SeqMemDataModule(data, max_length=48, micro_batch_size=4, pad_token_id=0, cache_dir=tmp_path),
            config,
            strategies=["pad"],
            max_lengths=[48],
            micro_batch_sizes=[2],
            device="cpu",
            precision="32-true",
            reference_copy=copy,
        ).memory.estimates[False][2]
        for copy in (False, True)
    ]
    alone, with_copy = results
    weights = alone.num_parameters * 4  # fp32
    assert with_copy.peak - alone.peak == weights == with_copy.state["reference"]
    assert with_copy.parameters == alone.parameters + weights
