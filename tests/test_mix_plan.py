"""``seqmem-plan`` on a ``Mix``: one kind planned on the documents its epoch reads; several kinds (text and
conversations, ``data=mix``) each planned by its own kind, the rows mixed as the run mixes them; pairs beside other
kinds refused by name."""

import json

import numpy as np
import pytest
from _forked_app import run_forked_main
from test_mix_datamodule import _docs

from lightning_seqmem import Mix, Pack, Pad, SeqMemDataModule
from lightning_seqmem.apps.plan_lengths import lengths_at
from lightning_seqmem.apps.plan_mix import _takes, mix_lengths, mix_sample
from lightning_seqmem.apps.planner import _strategy, plan, plan_strategy


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


# A mix of two kinds with disjoint lengths: short prose (at most ~12 tokens), long conversations (50+ tokens).
PROSE = [" ".join(["word"] * (1 + i % 6)) for i in range(120)]
CHAT = [
    {
        "messages": [
            {"role": "user", "content": "tell me " + "more " * (8 + i % 5)},
            {"role": "assistant", "content": "here it is: " + "detail " * (20 + 7 * (i % 9))},
        ]
    }
    for i in range(30)
]


SFT = [{"prompt": "question " * (1 + i % 9), "completion": "answer " * (30 + 3 * (i % 40))} for i in range(40)]


def _two_kinds(exhausted="repeat", by="tokens", weights=None, other="chat", **kw):
    sources = {"prose": PROSE, other: {"chat": CHAT, "sft": SFT}[other]}
    mix = Mix(sources, weights or {"prose": 0.3, other: 0.7}, by=by, exhausted=exhausted)
    return SeqMemDataModule(dataset=mix, **{"max_length": 96, "micro_batch_size": 4, "batching": Pad(), **kw})


@pytest.mark.parametrize("exhausted,by", [("repeat", "tokens"), ("stop", "tokens"), ("repeat", "documents")])
def test_the_mixed_histogram_holds_each_source_as_often_as_the_mix_reads_it(exhausted, by):
    train = mix_lengths(_two_kinds(exhausted, by))["train"]
    prose, chat = train.sources
    assert prose.kind.name == "text" and chat.kind.name == "conversations"
    assert prose.whole.max() < chat.whole.min()  # disjoint: each length in the mix says its source
    units = [s.whole if by == "tokens" else np.ones(len(s.whole)) for s in train.sources]
    kept = [prose.whole, lengths_at(chat.lengths, 96)[0]]  # the rows the run weighs: conversations cut at max_length
    kept = [k if by == "tokens" else np.ones(len(k)) for k in kept]
    times = _takes([int(k.sum()) for k in kept], [len(k) for k in kept], [0.3, 0.7], exhausted)
    assert [s.times for s in train.sources] == times
    mixed = train.lengths
    for source, u, t, own in zip(train.sources, units, times, (mixed <= prose.whole.max(), mixed >= chat.whole.min())):
        mass = mixed[own].sum() if by == "tokens" else own.sum()  # what the weight counts, of this source
        assert abs(mass - t * u.sum()) <= u.max()  # whole passes, then a part of one: within one document
        assert np.isin(mixed[own], source.whole).all()  # no document of another source
    prose_mass = mixed[mixed <= prose.whole.max()].sum()  # the run weighs the chat rows as cut at max_length
    share = prose_mass / (prose_mass + times[1] * kept[1].sum()) if by == "tokens" else None
    assert share is None or share == pytest.approx(0.3, abs=chat.whole.max() / mixed.sum())


@pytest.mark.parametrize("batching", [Pad(), Pack()])
@pytest.mark.parametrize("exhausted,other", [("repeat", "chat"), ("stop", "chat"), ("repeat", "sft"), ("stop", "sft")])
def test_a_mix_of_two_kinds_is_planned_as_the_datamodule_mixes_it(batching, exhausted, other):
    """Text with conversations or with prompt/completion rows: the configured candidate equals what the Mix
    DataModule reports on its mixed epoch, and the planned worst batch is at least each source's longest row."""
    dm = _two_kinds(exhausted, batching=batching, other=other)
    lengths = mix_lengths(dm)
    settings = dm.settings.batching
    planned = plan_strategy(lengths, batching, 96, settings)
    stats = dm.stats()["train"]
    for key in ("rows", "batches", "rows_dropped_per_epoch"):
        assert getattr(planned, key) == stats[key], key
    assert planned.token_efficiency == pytest.approx(stats["token_efficiency"])
    read = stats["sources"]
    assert planned.tokens_lost == round(
        sum(read[s]["passes"] * (read[s]["tokens_truncated"] + read[s]["tokens_dropped"]) for s in read)
    )
    rows, length = planned.max_batch_shape
    assert (rows, length) >= dm.max_batch_shape() and rows == 4
    for source in lengths["train"].sources:
        strategy = _strategy(batching, 96, settings, source.kind)
        assert length >= strategy.row_lengths(lengths_at(source.lengths, 96, strategy)[0])[0].max()
    assert planned.trained_share is not None and 0 < planned.trained_share < 1  # prompts carry no loss
    two_ranks = plan_strategy(lengths, batching, 96, settings, devices=2, accumulate_grad_batches=2)
    assert two_ranks.optimizer_steps == -(-len(dm._ready().sampler(num_replicas=2, rank=0)) // 2)


@pytest.mark.slow
def test_the_plan_of_two_kinds_lists_each_source_and_sizes_memory_at_the_worst_batch():
    from lightning_seqmem.apps.plan_report import format_plan
    from lightning_seqmem.training.building import build_model_config

    dm = _two_kinds(batching=Pad())
    config = build_model_config("tiny_llama", len(dm.tokenizer), dm.pad_token_id)
    result = plan(dm, config, strategies=["pad"], max_lengths=[96], micro_batch_sizes=[1, 4], device="cpu")
    assert [(s["name"], s["kind"]) for s in result.sources] == [("prose", "text"), ("chat", "conversations")]
    assert result.memory.length == result.configured.max_batch_shape[1]  # the mix's worst batch is what is traced
    text = format_plan(result)
    assert "Mix sources" in text and "'chat'  conversations" in text and "mixed: as an epoch reads them" in text


def test_preference_pairs_beside_text_are_refused_by_name():
    pairs = [{"prompt": "q", "chosen": "yes", "rejected": "no"}] * 8
    dm = SeqMemDataModule(dataset=Mix({"prose": PROSE, "pairs": pairs}, {"prose": 1, "pairs": 1}))
    with pytest.raises(ValueError, match="'prose': text, 'pairs': preference.*preference pairs mix only with"):
        plan(dm)


@pytest.mark.slow
def test_seqmem_plan_data_mix_prints_each_source_the_mix_and_memory(tmp_path):
    """``seqmem-plan data=mix`` (prose text + built-in conversations) as run from a shell (tests/_forked_app.py)."""
    from lightning_seqmem.apps.plan_app import main

    argv = [
        "seqmem-plan",
        "data=mix",
        "data.weights.chat=0.5",  # normalised with prose's 0.7
        "plan.max_lengths=[128,256]",
        "plan.strategies=[pad,pack_bfd]",
        "plan.micro_batch_sizes=[1,2]",
        "plan.histogram=null",
        "plan.strategy_chart=null",
        "plan.memory_chart=null",
        f"hydra.run.dir={tmp_path}",
    ]
    out = run_forked_main(main, argv, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    for text in ("'prose' text", "'chat'  conversations", "Train documents (mixed", "Peak training memory at length"):
        assert text in out.stdout, text
    record = json.loads((tmp_path / "plan.json").read_text())
    assert [s["name"] for s in record["sources"]] == ["prose", "chat"] and len(record["strategies"]) == 4
    assert [s["weight"] for s in record["sources"]] == pytest.approx([0.7 / 1.2, 0.5 / 1.2])


def test_a_candidate_that_leaves_a_source_no_row_is_named():
    with pytest.raises(ValueError, match="Mix source 'chat' gives no training row at max_length=4 .*weight 0"):
        plan(_two_kinds(), max_lengths=[4])


@pytest.mark.parametrize("exhausted", ["repeat", "stop"])
def test_the_passes_planned_are_the_runs(exhausted):
    """Each source's "read Nx" is the passes the DataModule's epoch makes over it (conversations longer than
    max_length count as the rows the run trains on, not whole)."""
    dm = _two_kinds(exhausted, weights={"prose": 0.7, "chat": 0.3})
    planned = {s.name: s.times for s in mix_lengths(dm)["train"].sources}
    dm.setup("fit")
    run = {name: s["passes"] for name, s in dm.stats()["train"]["sources"].items()}
    assert planned == pytest.approx(run, rel=0.05)
