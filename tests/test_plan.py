"""The planner's numbers equal what SeqMemDataModule measures; memory fitting, advice and bad input."""

import math

import numpy as np
import pytest

from lightning_seqmem import SeqMemDataModule
from lightning_seqmem.apps.planner import (
    PEAK_NOTES,
    STRATEGIES,
    build_plan,
    datamodule_lengths,
    format_plan,
    parse_bytes,
    plan_memory,
    plan_strategy,
)
from lightning_seqmem.batching.options import Pack, Pad, Truncate
from lightning_seqmem.batching.settings import BatchingSettings
from lightning_seqmem.memory.estimate import cached_estimate
from lightning_seqmem.training.building import MODEL_PRESETS, build_model_config

pytestmark = pytest.mark.filterwarnings("ignore:.*never reach the model.*")


def _check_equal(dm, lengths, strategy, max_length):
    stats, shape = dm.stats()["train"], dm.max_batch_shape()
    got = plan_strategy(lengths, strategy, max_length, dm.settings.batching)
    assert got.token_efficiency == stats["token_efficiency"]
    assert (got.rows, got.batches, got.tokens) == (stats["rows"], stats["batches"], stats["tokens"])
    assert got.tokens_lost == stats["tokens_truncated"] + stats["tokens_dropped"]
    assert got.rows_dropped_per_epoch == stats["rows_dropped_per_epoch"]
    assert got.max_batch_shape == tuple(shape)


@pytest.fixture(scope="module")
def builtin_lengths():
    """The built-in corpus's document lengths, read once for every strategy and max_length below."""
    lengths = datamodule_lengths(SeqMemDataModule(micro_batch_size=4, seed=3))
    for split in lengths.values():
        split.flags.writeable = False  # shared: a test that changed them would fail, not pass the change on
    return lengths


@pytest.mark.parametrize("strategy", STRATEGIES, ids=repr)
@pytest.mark.parametrize("max_length", [64, 256])
def test_every_strategy_matches_the_datamodule_on_the_builtin_corpus(builtin_lengths, strategy, max_length):
    lengths = builtin_lengths
    dm = SeqMemDataModule(max_length=max_length, micro_batch_size=4, seed=3, batching=strategy)
    _check_equal(dm, lengths, strategy, max_length)


SETTINGS = [dict(drop_last=True, micro_batch_size=3), dict(max_tokens_per_batch=256), dict(eval_batch_size=5)]
CASES = [(s, e) for s in (Pad(), Truncate(), Pack()) for e in SETTINGS]
CASES += [(s, {}) for s in (Pad(to_multiple_of=None), Pad(group_by_length=True))]
CASES += [(Pack(overflow=o), e) for o in ("truncate", "drop") for e in ({}, dict(max_tokens_per_batch=256))]


@pytest.mark.parametrize("strategy,extra", CASES, ids=repr)
def test_settings_are_honoured_on_a_small_dataset(small_text_dataset, strategy, extra):
    base = dict(dataset=small_text_dataset, max_length=64, seed=1, **{"micro_batch_size": 4, **extra})
    lengths = datamodule_lengths(SeqMemDataModule(**base))
    _check_equal(SeqMemDataModule(**base, batching=strategy), lengths, strategy, 64)


@pytest.mark.parametrize("strategy", [Pad(), Pack()], ids=repr)
def test_pretokenized_data_without_a_tokenizer_is_planned_from_its_offsets(tmp_path, strategy):
    """Pre-tokenized ids given with their own pad id: no tokenizer is loaded, the plan equals the DataModule."""
    import datasets

    rows = [[9000 + (i * 7 + j) % 900 for j in range(1 + (i * 13) % 70)] for i in range(60)]
    base = dict(
        dataset=datasets.Dataset.from_dict({"input_ids": rows}),
        pad_token_id=0,
        max_length=32,
        micro_batch_size=4,
        cache_dir=tmp_path,
    )
    probe = SeqMemDataModule(**base)
    lengths = datamodule_lengths(probe)
    assert probe.tokenizer is None and sum(map(sum, (lengths["train"], lengths["validation"]))) == sum(map(len, rows))
    _check_equal(SeqMemDataModule(**base, batching=strategy), lengths, strategy, 32)


def test_optimizer_steps_follow_devices_and_accumulation(small_text_dataset):
    lengths = datamodule_lengths(SeqMemDataModule(dataset=small_text_dataset))
    one = plan_strategy(lengths, "pad", 64, BatchingSettings(micro_batch_size=2))
    four = plan_strategy(lengths, "pad", 64, BatchingSettings(micro_batch_size=2), devices=2, accumulate_grad_batches=3)
    assert one.optimizer_steps == one.batches == math.ceil(one.rows / 2)
    assert four.optimizer_steps == math.ceil(math.ceil(one.rows / 4) / 3)


def test_bad_input_says_what_is_wrong():
    lengths = {"train": np.array([3, 5, 9]), "validation": np.array([4])}
    settings = BatchingSettings()
    with pytest.raises(
        ValueError, match=r"Unknown strategy 'paddington'; choose one of \['pad', 'truncate', 'pack_bfd'"
    ):
        build_plan(lengths, [Pad(), "paddington"], [64], settings, (Pad(), 64))
    with pytest.raises(
        ValueError, match=r"No strategies to plan; give batching names, e.g. \['pad', 'pad\(to_max_length=True\)', "
    ):
        build_plan(lengths, [], [64], settings, (Pad(), 64))
    with pytest.raises(ValueError, match="non-empty list of ints >= 2"):
        build_plan(lengths, [Pad()], [], settings, (Pad(), 64))
    with pytest.raises(ValueError, match="non-empty list of ints >= 2"):
        build_plan(lengths, [Pad()], [64, 0], settings, (Pad(), 64))
    with pytest.raises(ValueError, match="80GiB"):
        parse_bytes("eighty gigs")
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("1.5 GB") == 1_500_000_000


def _tiny_estimate(vocab_size=512, device="cuda"):
    """Estimates of a one-layer tiny_llama: what these tests check (the search, the margin, the advice, the tables)
    does not depend on depth, and each layer adds thousands of traced ops to every estimate. Remembered per shape
    (``cached_estimate``, as the callbacks remember them), so a shape two tests ask for is traced once."""
    cfg = build_model_config({**MODEL_PRESETS["tiny_llama"], "num_hidden_layers": 1}, vocab_size, 0)
    keys = ("input_ids", "attention_mask", "labels")
    return lambda rows, length, ckpt: cached_estimate(
        cfg, rows, length, keys, device=device, gradient_checkpointing=ckpt
    )


@pytest.mark.slow
def test_largest_micro_batch_that_fits_the_budget_with_a_margin():
    estimate = _tiny_estimate()
    budget = estimate(4, 128, False).peak / 0.9 + 1  # 4 rows fit exactly inside the 10% margin
    memory = plan_memory(estimate, 128, [1, 2, 4, 8, 16], budget=int(budget), margin=0.1)
    assert memory.fits[False] == 4
    assert memory.fits[True] >= 4  # checkpointing never needs more
    assert memory.estimates[False][8].peak > memory.usable  # the search stopped at the first that does not fit
    assert 16 not in memory.estimates[False]


@pytest.mark.slow
def test_no_micro_batch_fits_says_what_would():
    estimate = _tiny_estimate()
    one_row = estimate(1, 512, False).peak
    memory = plan_memory(
        estimate, 512, [1, 2, 4], budget=int(one_row * 0.95), margin=0.0, shorter_lengths=[64, 128, 512]
    )
    assert memory.fits[False] is None
    assert "No micro_batch_size fits" in memory.advice
    assert "gradient checkpointing" in memory.advice or "max_length=" in memory.advice


@pytest.mark.slow
def test_build_plan_prints_tables_and_a_recommendation(small_text_dataset):
    lengths = datamodule_lengths(SeqMemDataModule(dataset=small_text_dataset))
    plan = build_plan(
        lengths,
        list(STRATEGIES),
        [32, 128],
        BatchingSettings(micro_batch_size=4),
        (Pad(), 128),
        estimate=_tiny_estimate(),
        micro_batch_sizes=[1, 2, 4],
        budget=2**30,
    )
    text = format_plan(plan)
    assert len(plan.strategies) == 10 and "<- config" in text and "Recommended:" in text
    assert plan.recommended["strategy"].startswith("pack_")  # packing loses nothing and wastes the least
    assert plan.recommended["micro_batch_size"] == 4  # everything fits 1 GiB
    assert plan.distribution["percentiles"][100] == int(lengths["train"].max())
    # The memory table says where each peak falls and why a column is short there, never a bare "0 B".
    memory = text[text.index("Peak training memory") : text.index("Recommended:")]
    assert "falls in" in memory and "live at the peak" in memory and " 0 B " not in memory
    for phase in {e.peak_phase for by_rows in plan.memory.estimates.values() for e in by_rows.values()}:
        assert PEAK_NOTES[phase] in memory


def test_plan_api_from_a_datamodule_and_a_model_config(small_text_dataset):
    from lightning_seqmem.apps.planner import plan

    dm = SeqMemDataModule(small_text_dataset, max_length=64, micro_batch_size=2, strategy="pack")
    one_layer = {**MODEL_PRESETS["tiny_gpt2"], "n_layer": 1}  # traced whole; deep ones: test_plan_app, layer_scaling
    result = plan(
        dm,
        build_model_config(one_layer, len(dm.tokenizer), 0),
        max_lengths=[32, 64],
        micro_batch_sizes=[1, 2],
        gpu_memory="1GiB",
        device="cpu",
        precision="32-true",
    )
    assert (result.configured.batching, result.configured.max_length) == (Pack(method="bfd"), 64)
    assert result.configured.strategy == "pack_bfd"
    assert result.configured.max_batch_shape == dm.max_batch_shape()
    assert result.memory.fits == {False: 2, True: 2}
    assert result.recommended["micro_batch_size"] == 2


@pytest.mark.parametrize(
    "batching",
    [
        Pad(),
        Truncate(),
        Pack(overflow="split"),
        Pack(overflow="drop"),
        Pack(overflow="truncate"),
        Pack(method="wrapped", overflow="split"),
    ],
    ids=repr,
)
def test_lengths_only_plan_equals_the_token_plan(batching):
    from lightning_seqmem.batching.strategies import make_strategy
    from lightning_seqmem.data.tokens import as_token_source

    docs = [list(range(n)) for n in np.random.default_rng(0).integers(1, 40, 50)]
    strategy = make_strategy(BatchingSettings(max_length=16, batching=batching))
    source = as_token_source(docs)
    full = strategy.rows(source)
    lengths, cut = strategy.row_lengths(source.lengths)
    assert np.array_equal(lengths, full.lengths) and cut == full.stats and len(full.rows) == len(lengths)
    lost = sum(cut.get(k, 0) for k in ("tokens_truncated", "tokens_dropped"))
    assert lost + int(lengths.sum()) == sum(map(len, docs))  # every token fed or counted


@pytest.mark.slow
def test_memory_table_says_where_the_peak_falls_and_what_is_live_there():
    """Past a few rows this model's peak moves from the forward to early backward, where no gradient of the step
    exists yet: the table says so instead of printing a bare 0 B under gradients."""
    from lightning_seqmem.apps.planner import memory_table
    from lightning_seqmem.memory.stats import format_bytes

    memory = plan_memory(_tiny_estimate(2048, device="cpu"), 256, [1, 8])
    lines = memory_table(memory)
    rows = {(int(line.split()[0]), line.split()[1] == "yes"): line for line in lines[3:] if line.split()[0].isdigit()}
    phases = set()
    for (n, ckpt), line in rows.items():
        e = memory.estimates[ckpt][n]
        phases.add(e.peak_phase)
        assert f" {e.peak_phase} " in line and format_bytes(e.peak) in line
        if e.gradients == 0:
            assert f"none yet of {format_bytes(e.state['gradients'])}" in line and " 0 B " not in line
    assert {"forward", "backward"} <= phases
    assert [line for line in lines if line.startswith("Peak in backward")]


@pytest.mark.slow
def test_the_shorter_length_advice_is_left_to_the_fit_search():
    """``seqmem-plan`` with a budget runs the fit search, which estimates what fits: the plan then traces no shorter
    max_length for its own advice (two traces of an 8B shape it used to pay for)."""
    inner, asked = _tiny_estimate(), []

    def estimate(rows, length, ckpt):
        asked.append(length)
        return inner(rows, length, ckpt)

    lengths = {"train": np.full(40, 500), "validation": np.full(4, 500)}
    budget = int(inner(1, 512, False).peak * 0.95)  # nothing fits at 512 without checkpointing
    for shorter_advice in (True, False):
        asked.clear()
        plan = build_plan(
            lengths,
            [Pad()],
            [128, 512],
            BatchingSettings(),
            (Pad(), 512),
            estimate,
            [1],
            budget,
            0.0,
            shorter_advice=shorter_advice,
        )
        assert (128 in asked) == shorter_advice and "No micro_batch_size fits" in plan.memory.advice
