"""``SeqMemDataModule(dataset=Mix(...))`` as users meet it: the share in every prefix of the real loader's batches
(pad, truncate, pack, token budget), per-source counts, per-source validation loss through a real Trainer and CSV
logger, exact resume through ``ckpt_path``, and bad sources named."""

import csv
import json
import warnings

import lightning.pytorch as L
import numpy as np
import pytest
import torch
from _recorder import fit_recording

from lightning_seqmem import CausalLM, Mix, Pack, Pad, SeqMemDataModule, Truncate
from lightning_seqmem.apps.summary import RunSummary
from lightning_seqmem.batch import SOURCE_INDEX

MAX = 32
RANGES = {"long": (10, 100), "short": (100, 200)}  # disjoint ids: a token's source is its id


def _docs(seed=0, n_long=40, n_short=300):
    """Pre-tokenized documents with very different lengths: ``long`` 20-120 tokens, ``short`` 2-8."""
    rng = np.random.default_rng(seed)
    long = [{"input_ids": rng.integers(10, 100, size=int(n)).tolist()} for n in rng.integers(20, 121, size=n_long)]
    short = [{"input_ids": rng.integers(100, 200, size=int(n)).tolist()} for n in rng.integers(2, 9, size=n_short)]
    return {"long": long, "short": short}


def _mix(weights=None, **kw):
    return Mix(_docs(), weights or {"long": 0.3, "short": 0.7}, **kw)


def _dm(mix=None, **kw):
    args = {"max_length": MAX, "micro_batch_size": 4, "pad_token_id": 0, "batching": Pack(), **kw}
    return SeqMemDataModule(dataset=mix or _mix(), **args)


def _source_tokens(batch):
    ids = batch["input_ids"]
    return [int(((ids >= lo) & (ids < hi)).sum()) for lo, hi in RANGES.values()]


@pytest.mark.parametrize(
    "batching",
    [
        {"batching": Pack()},
        {"batching": Pad()},
        {"batching": Truncate()},
        {"batching": Pad(), "max_tokens_per_batch": 96},
    ],
    ids=["pack", "pad", "truncate", "pad-budget"],
)
def test_every_batch_prefix_holds_each_share_within_one_row(batching):
    dm = _dm(**batching)
    served, weights = np.zeros(2), np.asarray([0.3, 0.7])
    rows, length = dm.max_batch_shape()  # what pre-allocation sizes for: no mixed batch is larger
    for batch in dm.train_dataloader():
        served += _source_tokens(batch)
        assert np.abs(weights * served.sum() - served).max() <= MAX
        assert batch["input_ids"].numel() <= rows * length
    train = dm.stats()["train"]
    assert served.tolist() == [train["sources"][n]["tokens_read"] for n in RANGES]
    assert train["sources"]["short"]["share"] == pytest.approx(0.7, abs=MAX / served.sum())


def test_repeat_and_stop_are_counted_per_source():
    repeat = _dm(_mix()).stats()["train"]["sources"]
    assert repeat["long"]["passes"] == 1.0 and repeat["long"]["rows_unread"] == 0
    assert repeat["short"]["repeats"] >= 1 and repeat["short"]["passes"] > 1  # short runs out and starts again
    stop = _dm(_mix(exhausted="stop")).stats()["train"]
    assert stop["sources"]["short"]["passes"] == 1.0 and stop["sources"]["short"]["repeats"] == 0
    assert stop["sources"]["long"]["rows_unread"] > 0 and stop["rows_dropped_per_epoch"] > 0


def test_validation_keeps_each_source_apart():
    dm = _dm()
    seen = {}
    for batch in dm.val_dataloader():
        (source,) = set(batch[SOURCE_INDEX].tolist())  # one source per batch
        seen[source] = seen.get(source, 0) + sum(_source_tokens(batch))
        assert _source_tokens(batch)[1 - source] == 0
    assert sorted(seen) == [0, 1] and dm.source_names() == ("long", "short")
    assert SOURCE_INDEX not in next(iter(dm.train_dataloader()))


def test_per_source_validation_loss_is_logged_beside_the_total(tmp_path):
    dm = _dm()
    model = CausalLM(model_config="tiny_llama", vocab_size=256, pad_token_id=0)
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=L.loggers.CSVLogger(tmp_path, name="csv"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        val_check_interval=2,
        callbacks=[RunSummary(path=str(tmp_path / "summary.json"), print_table=False)],
    )
    trainer.fit(model, datamodule=dm)
    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        row = [r for r in csv.DictReader(f) if r.get("val/loss")][-1]
    per = {name: float(row[f"val/loss/{name}"]) for name in ("long", "short")}
    # val/loss is the token-weighted total: the per-source losses weighted by their predicted tokens
    tokens = {name: 0 for name in per}
    for batch in dm.val_dataloader():
        tokens[dm.source_names()[int(batch[SOURCE_INDEX][0])]] += int((batch["labels"][:, 1:] != -100).sum())
    total = sum(per[n] * tokens[n] for n in per) / sum(tokens.values())
    assert float(row["val/loss"]) == pytest.approx(total, rel=1e-4)
    assert per["long"] != pytest.approx(per["short"])
    summary = json.loads((tmp_path / "summary.json").read_text())  # the run summary: each source's numbers
    assert summary["final_val_loss_long"] == pytest.approx(per["long"], rel=1e-4)
    sources = dm.stats()["train"]["sources"]
    # what the run read of each source (its share of the tokens trained), not the planned epoch (apps/mix_report.py)
    for name in ("long", "short"):
        read = round(sources[name]["share"] * summary["real_tokens_trained"])
        assert summary[f"source_{name}_tokens_read"] == read < sources[name]["tokens_read"]


def test_resume_through_a_checkpoint_gives_the_same_batches(tmp_path):
    data = {"dataset": _mix(), "pad_token_id": 0}
    full, _ = fit_recording(tmp_path / "full", 8, **data)
    fit_recording(tmp_path, 3, save=True, **data)
    resumed, _ = fit_recording(tmp_path, 8, ckpt=str(tmp_path / "epoch=0-step=3.ckpt"), **data)
    assert resumed == full[3:]
    mixer = _find(torch.load(tmp_path / "epoch=0-step=3.ckpt", weights_only=True), "mixer")  # the loader's state
    assert sum(mixer["rows_served"]) == 3 * 8 and set(mixer) == {"served", "rows_served", "position", "passes"}
    with pytest.raises(
        ValueError, match=r"weights: \{'long': 0\.3, 'short': 0\.7\} -> \{'long': 0\.5, 'short': 0\.5\}"
    ):
        fit_recording(
            tmp_path,
            8,
            ckpt=str(tmp_path / "epoch=0-step=3.ckpt"),
            dataset=_mix({"long": 1, "short": 1}),
            pad_token_id=0,
        )
    with pytest.warns(UserWarning, match="restarts from its first batch"):
        fit_recording(
            tmp_path,
            5,
            ckpt=str(tmp_path / "epoch=0-step=3.ckpt"),
            dataset=_mix({"long": 1, "short": 1}),
            pad_token_id=0,
            on_resume_mismatch="restart_epoch",
        )


def test_a_stop_mix_resumed_in_a_later_epoch_gives_the_same_batches(tmp_path):
    """A cut in the second epoch (``stop``: a short epoch, each source reshuffled every epoch), run to the third."""
    epochs, data = 3, {"dataset": _mix(exhausted="stop"), "pad_token_id": 0, "micro_batch_size": 4}
    _, dm = fit_recording(tmp_path / "probe", 1, **data)
    per_epoch = len(dm.train_dataloader())
    cut = 3 * ((per_epoch + 3) // 3)  # the first checkpoint (every 3 steps) past the first epoch
    total = epochs * per_epoch
    full, _ = fit_recording(tmp_path / "full", total, **data)
    fit_recording(tmp_path, cut, save=True, **data)
    (ckpt,) = [p for p in tmp_path.glob("*.ckpt") if p.name.endswith(f"step={cut}.ckpt")]
    resumed, _ = fit_recording(tmp_path, total, ckpt=str(ckpt), **data)
    assert resumed == full[cut:] and len(resumed) > 0


def _find(tree, key):
    """The first value under ``key`` anywhere in nested dicts and lists."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        for item in tree:
            found = _find(item, key)
            if found is not None:
                return found
    return None


def test_bad_sources_are_named():
    docs = _docs()
    with pytest.raises(ValueError, match="Mix source 'empty'"):
        _dm(Mix({"long": docs["long"], "empty": [{"input_ids": []}]})).setup("fit")
    with pytest.raises(ValueError, match="Mix source 'blank': Every training document is empty"):
        _dm(Mix({"long": docs["long"], "blank": [{"text": ""}] * 20}), tokenizer=None).setup("fit")
    too_long = [{"input_ids": list(range(100, 100 + MAX + 5))}] * 20  # every document dropped by the overflow rule
    with pytest.raises(ValueError, match="Mix source 'long' gives no training row: every document was dropped"):
        _dm(Mix({"long": too_long, "short": docs["short"]}), batching=Pack(overflow="drop")).setup("fit")
    pairs = [{"prompt": "a", "chosen": "b", "rejected": "c"}] * 8
    with pytest.raises(ValueError, match="Mix source 'pairs' holds preference data.*preference pairs mix only"):
        SeqMemDataModule(dataset=Mix({"text": "builtin", "pairs": pairs}), max_length=64).setup("fit")
    with pytest.raises(ValueError, match="Mix source 'long': The stream holds 40 documents"):
        _dm(streaming=True).setup("fit")  # each source's validation head comes out of its own documents


def test_text_sources_take_their_own_columns(tokenizer):
    a = [{"text": f"alpha document {i} " * 3} for i in range(30)]
    b = [{"body": f"beta {i} " * 20} for i in range(30)]
    dm = SeqMemDataModule(dataset=Mix({"a": a, "b": {"dataset": b, "text_column": "body"}}), max_length=64)
    stats = dm.stats()["train"]["sources"]
    assert stats["a"]["documents"] > 0 and stats["b"]["documents"] > 0
    assert abs(stats["a"]["share"] - 0.5) <= 64 / (stats["a"]["tokens_read"] + stats["b"]["tokens_read"])
    assert isinstance(next(iter(dm.train_dataloader()))["input_ids"], torch.Tensor)


class _Batches(L.Callback):
    """Records each rank's training batches (their token counts per source and their row ids)."""

    def __init__(self):
        self.tokens, self.rows = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.tokens.append(_source_tokens(batch))
        self.rows.append(batch["input_ids"].tolist())


def _ddp_rank(rank, tmp):
    dm = _dm(_mix(exhausted="stop"))
    seen = _Batches()
    trainer = L.Trainer(
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        max_epochs=1,
        logger=L.loggers.CSVLogger(tmp, name="csv"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        callbacks=[seen],
        use_distributed_sampler=True,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(CausalLM(model_config="tiny_llama", vocab_size=256, pad_token_id=0), datamodule=dm)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/loss")}
    unsynced = [str(w.message) for w in caught if "sync_dist=True" in str(w.message)]
    return {"tokens": seen.tokens, "rows": seen.rows, "metrics": metrics, "unsynced": unsynced}


@pytest.mark.slow
def test_two_gloo_ranks_each_hold_the_share_and_read_each_document_once(tmp_path):
    from _forked_ranks import run_ranks

    r0, r1 = run_ranks(_ddp_rank, str(tmp_path), timeout=300)
    assert len(r0["tokens"]) == len(r1["tokens"]) > 0  # the same number of steps: no rank waits
    for r in (r0, r1):
        served = np.cumsum(np.asarray(r["tokens"]), axis=0)
        assert np.abs(np.asarray([0.3, 0.7]) * served.sum(1, keepdims=True) - served).max() <= MAX
    # exhausted="stop": no packed row twice, on a rank or across the two (each row's token ids are its fingerprint)
    rows = [tuple(x for x in row if x) for r in (r0, r1) for batch in r["rows"] for row in batch]
    assert len(set(rows)) == len(rows)
    assert r0["metrics"] == r1["metrics"] and {"val/loss", "val/loss/long", "val/loss/short"} <= set(r0["metrics"])
    # Each source's loss and val/ppl are summed over the ranks already: Lightning warned they were not synced.
    assert r0["unsynced"] == r1["unsynced"] == []


def test_warmup_reshape_keeps_every_mixed_token():
    from lightning_seqmem.warmup.transform import set_batch_sequence_length

    for batch in _dm().train_dataloader():
        before = _source_tokens(batch)
        assert _source_tokens(set_batch_sequence_length(batch, 8, truncate=False, pad_token_id=0)) == before


def test_by_documents_holds_the_document_share_and_misses_the_token_share():
    """The control: mixing by documents keeps the documents' share at every step, and with documents of very
    different lengths puts far more than its weight of the tokens in from the long source."""
    dm = _dm(_mix(by="documents"))
    docs, tokens = np.zeros(2), np.zeros(2)
    for batch in dm.train_dataloader():
        starts = (batch["position_ids"] == 0) & (batch["input_ids"] != 0)  # a document (piece) starts a segment
        ids = batch["input_ids"]
        docs += [int((starts & (ids < 100)).sum()), int((starts & (ids >= 100)).sum())]
        tokens += _source_tokens(batch)
        assert np.abs(np.asarray([0.3, 0.7]) * docs.sum() - docs).max() <= MAX  # a packed row holds <= MAX pieces
    assert tokens[0] / tokens.sum() > 0.6  # weight 0.3 of the documents: over 60 % of the tokens


def test_a_weight_of_zero_leaves_a_source_out_of_training_but_validates_it():
    dm = _dm(_mix({"long": 0, "short": 1}))
    served = sum(np.asarray(_source_tokens(b)) for b in dm.train_dataloader())
    assert served[0] == 0 and served[1] > 0
    long = dm.stats()["train"]["sources"]["long"]
    assert long["passes"] == 0 and long["rows_unread"] == long["rows"]
    assert {int(b[SOURCE_INDEX][0]) for b in dm.val_dataloader()} == {0, 1}


@pytest.mark.parametrize("batching", [Pack(), Pad()], ids=["pack", "pad"])
def test_each_sources_efficiency_in_the_mix_adds_up_to_the_whole(batching):
    train = _dm(batching=batching).stats()["train"]
    sources = train["sources"].values()
    slots = sum(s["tokens_read"] / s["token_efficiency_in_mix"] for s in sources)
    assert sum(s["tokens_read"] for s in sources) / slots == pytest.approx(train["token_efficiency"])
    if isinstance(batching, Pad):  # short rows padded to the long rows they share batches with
        assert train["sources"]["short"]["token_efficiency_in_mix"] < train["sources"]["short"]["token_efficiency"]
