"""A ``Mix`` as ``seqmem-train`` reports it (apps/mix_report.py): the shares at the start as the weights make them,
what truncation costs a source, and the summary's per-source rows of what the run read (no empty rows for streams)."""

import pytest
from test_mix_datamodule import _docs
from test_mix_streams import _stream_dm

from lightning_seqmem import Mix, SeqMemDataModule
from lightning_seqmem.apps.mix_report import source_rows, start_line


def _dm(weights, max_length=32):
    dm = SeqMemDataModule(dataset=Mix(_docs(), weights), max_length=max_length, micro_batch_size=4, pad_token_id=0)
    dm.setup("fit")
    return dm


@pytest.mark.parametrize("weights", [{"long": 0.7, "short": 0.3}, {"long": 0.7, "short": 0.5}])
def test_the_start_line_gives_the_shares_the_weights_make(weights):
    """Weights are normalised: 0.7 beside 0.5 is 58.3 % and 41.7 % (within a row), and the line says what the
    epoch reads."""
    dm = _dm(weights)
    total = sum(weights.values())
    line = start_line(dm)
    read = {n: s["share"] for n, s in dm.stats()["train"]["sources"].items()}  # the epoch's shares of the tokens
    for name in weights:
        assert f"{name} {100 * read[name]:.1f} %" in line
    assert read == pytest.approx({n: w / total for n, w in weights.items()}, abs=0.02)


def test_a_source_that_loses_tokens_to_truncation_is_named_at_the_start():
    """Long documents cut at max_length (packed rows of a kind that truncates would say it the same way): the line
    names the source and the share of its tokens lost, or nothing when the loss is small."""
    from lightning_seqmem import Truncate

    mix = Mix(_docs(), {"long": 0.5, "short": 0.5})
    dm = SeqMemDataModule(dataset=mix, max_length=8, micro_batch_size=4, pad_token_id=0, batching=Truncate())
    dm.setup("fit")
    source = dm.stats()["train"]["sources"]["long"]
    lost = source["tokens_truncated"] / source["tokens"]
    assert lost > 0.05 and f"long loses {100 * lost:.0f} % of its tokens to truncation" in start_line(dm)
    assert "short loses" not in start_line(dm)


def test_summary_rows_are_what_the_run_read():
    """A map-style mix: each source's share of the real tokens trained and the passes over it that makes (half the
    epoch's tokens: half its passes); a stream's counts as read; no row left empty."""
    dm = _dm({"long": 0.5, "short": 0.5})
    sources = dm.stats()["train"]["sources"]
    epoch = sum(s["tokens_read"] for s in sources.values())
    for source in sources.values():
        rows = source_rows(source, epoch // 2)
        assert rows["tokens_read"] == round(source["share"] * (epoch // 2))
        assert rows["passes_read"] == pytest.approx(source["passes"] / 2, rel=0.02)
        assert None not in rows.values()
    stream = _stream_dm()
    stream.setup("fit")
    next(iter(stream.train_dataloader()))
    for source in stream.stats()["train"]["sources"].values():
        rows = source_rows(source, 100)
        assert rows and None not in rows.values()
