"""Preference pairs through ``SeqMemDataModule`` as users meet them: text pairs (a ``Dataset``, a jsonl file, a
Python list) and pre-tokenized pairs, tokenized once through the token cache, truncated as TRL's guide says, every
lost token counted in ``stats()``, batched padded (equal to TRL 1.16's ``DataCollatorForPreference``) or packed, and
trained with ``DPO`` under a real Trainer."""

import json
import warnings

import datasets
import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from lightning_seqmem import DPO, SeqMemDataModule
from lightning_seqmem.batch import SEQUENCE_INDEX, count_real_tokens
from lightning_seqmem.batching.options import Pack, Pad

TINY = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
)


def text_rows(n=40):
    """Pairs with prompts and completions of different lengths (some cut by max_length=32)."""
    rows = []
    for i in range(n):
        rows.append(
            {
                "prompt": f"Question {i}: how do I sort a list in Python?" + " Please explain." * (i % 4),
                "chosen": "Call sorted(items) or items.sort()." + " It is stable." * (i % 6),
                "rejected": "Lists cannot be sorted." + " Sorry." * (i % 3),
            }
        )
    return rows


def splits(rows):
    return datasets.DatasetDict(
        train=datasets.Dataset.from_list(rows[8:]), validation=datasets.Dataset.from_list(rows[:8])
    )


def module(dataset, tmp_path, **kwargs):
    kwargs = {"max_length": 32, "micro_batch_size": 4, "eval_batch_size": 8, "cache_dir": tmp_path / "cache", **kwargs}
    dm = SeqMemDataModule(dataset, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dm.setup("fit")
    return dm


def quiet_trainer(**kwargs):
    return pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_padded_pairs_equal_trls_collator_on_the_same_rows(tokenizer, tmp_path, mode):
    trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")
    rows = text_rows()
    dm = module(splits(rows), tmp_path, truncation_mode=mode, batching=Pad(to_multiple_of=None))
    ours = next(iter(dm.val_dataloader()))  # validation keeps the dataset's order
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    pairs = [
        {
            "prompt_ids": [bos] + enc(r["prompt"]),
            "chosen_ids": enc(r["chosen"]) + [eos],
            "rejected_ids": enc(r["rejected"]) + [eos],
        }
        for r in rows[:8]
    ]
    assert max(len(p["prompt_ids"]) + len(p["chosen_ids"]) for p in pairs) > 32  # really cut
    theirs = trl_dpo.DataCollatorForPreference(
        pad_token_id=tokenizer.pad_token_id, max_length=32, truncation_mode=mode
    )(pairs)
    assert ours["input_ids"].shape[0] == 16  # [2B, L]: chosen rows, then rejected rows
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key


def test_every_source_gives_the_same_pairs(tokenizer, tmp_path):
    rows = text_rows()
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm_list = module(rows, tmp_path)
    dm_file = module(str(path), tmp_path)
    dm_dataset = module(datasets.Dataset.from_list(rows), tmp_path)
    # Pre-tokenized pairs, with the ids the cache wrote: the same batches without a tokenizer call.
    tokenized, kind = dm_dataset.tokenized_documents()
    assert kind.name == "preference" and not kind.pretokenized
    ids = datasets.DatasetDict({s: d.remove_columns("length") for s, d in tokenized.items()})
    dm_ids = module(ids, tmp_path, pad_token_id=tokenizer.pad_token_id)
    reference = dm_dataset.stats()
    for dm in (dm_list, dm_file, dm_ids):
        assert dm.stats() == reference
        assert all(
            torch.equal(a, b)
            for a, b in zip(next(iter(dm.val_dataloader())).values(), next(iter(dm_dataset.val_dataloader())).values())
        )


@pytest.mark.parametrize("strategy", ["pad", "truncate", "pack"])
def test_stats_count_every_token_and_shapes_count_pairs(tokenizer, tmp_path, strategy):
    # Pre-tokenized, so that one prompt is exactly max_length long: under keep_start its pair keeps no completion.
    rng = np.random.default_rng(0)
    rows = [
        {
            "prompt_ids": rng.integers(3, 100, rng.integers(1, 20)).tolist(),
            "chosen_ids": rng.integers(3, 100, rng.integers(1, 30)).tolist(),
            "rejected_ids": rng.integers(3, 100, rng.integers(1, 30)).tolist(),
        }
        for _ in range(60)
    ]
    rows[5]["prompt_ids"] = list(range(3, 35))  # 32 tokens: nothing left for a completion
    rows[7]["rejected_ids"] = rows[7]["chosen_ids"]
    dm = module(
        datasets.DatasetDict(train=datasets.Dataset.from_list(rows), validation=datasets.Dataset.from_list(rows[:4])),
        tmp_path,
        strategy=strategy,
        pad_token_id=0,
        max_completion_length=20,
    )
    stats = dm.stats()["train"]
    assert stats["rows_without_completion"] == 1 and stats["rows_chosen_equals_rejected"] == 1
    total = sum(2 * len(r["prompt_ids"]) + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows)
    assert stats["tokens"] == total
    fed, largest = 0, (0, 0)
    for batch in dm.train_dataloader():
        fed += int(count_real_tokens(batch, 0))
        largest = max(largest, tuple(batch["input_ids"].shape))
    assert fed == stats["tokens"] - stats["tokens_truncated"] - stats["tokens_dropped"]
    rows_, length = dm.max_batch_shape()
    if strategy == "pack":
        assert SEQUENCE_INDEX in dm.batch_keys() and (rows_, length) == (4, 64)  # B rows of 2 * max_length
    else:
        assert rows_ == 8 and length <= 32  # 2B rows
    assert largest[0] <= rows_ and largest[1] <= length


def test_bad_pairs_get_clear_errors(tmp_path):
    rows = text_rows(12)
    with pytest.raises(ValueError, match="rejected"):  # a column missing
        module([{k: r[k] for k in ("prompt", "chosen")} | {"rejected_text": "x"} for r in rows], tmp_path)
    broken = [dict(r) for r in rows]
    broken[4]["chosen"] = None
    with pytest.raises(TypeError, match="Row 4 .*'chosen'"):  # a pair missing its chosen answer
        module(broken, tmp_path)
    ids = [{"prompt_ids": [5, 6], "chosen_ids": [7], "rejected_ids": [8, 9]} for _ in range(10)]
    ids[3]["rejected_ids"] = []
    with pytest.raises(ValueError, match="row 3: empty rejected completion"):
        module(
            datasets.DatasetDict(train=datasets.Dataset.from_list(ids), validation=datasets.Dataset.from_list(ids[:2])),
            tmp_path,
            pad_token_id=0,
        )
    ids[3]["rejected_ids"], ids[6]["prompt_ids"] = [8], list(range(3, 50))
    dm = module(  # a prompt longer than max_length on its own trains nothing: dropped and counted, not refused
        datasets.DatasetDict(train=datasets.Dataset.from_list(ids), validation=datasets.Dataset.from_list(ids[:2])),
        tmp_path,
        pad_token_id=0,
    )
    assert dm.stats()["train"]["pairs_dropped_overlong_prompt"] == 1


def test_identical_pairs_are_warned_and_counted(tmp_path):
    rows = text_rows(20)
    rows[12]["rejected"] = rows[12]["chosen"]  # a short prompt: the pair keeps both completions
    with pytest.warns(UserWarning, match=r"1 pair\(s\) with chosen == rejected"):
        dm = SeqMemDataModule(splits(rows), max_length=32, cache_dir=tmp_path)
        dm.setup("fit")
    assert dm.stats()["train"]["rows_chosen_equals_rejected"] == 1


@pytest.mark.parametrize("strategy", ["pad", "pack"])
def test_dpo_trains_on_pairs_with_a_real_trainer(tmp_path, strategy):
    dm = SeqMemDataModule(
        splits(text_rows()),
        max_length=32,
        micro_batch_size=4,
        strategy=strategy,
        max_prompt_length=16,
        cache_dir=tmp_path,
    )
    model = DPO(model_config={**TINY, "attention_dropout": 0.5}, learning_rate=1e-2, beta=0.5)
    trainer = quiet_trainer(max_steps=4, limit_val_batches=1, val_check_interval=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=dm)
    assert not [w for w in caught if "eval mode" in str(w.message)]  # the frozen copy is not left in eval mode
    batch = next(iter(dm.train_dataloader()))
    model.train()
    first, again = model.reference_logps(batch), model.reference_logps(batch)
    assert all(torch.equal(a, b) for a, b in zip(first, again))  # but its forward runs without dropout
    assert model.reference_model.training  # and is left in the module's mode
    metrics = trainer.callback_metrics
    assert {"train/loss", "train/reward_margin", "val/loss", "val/reward_accuracy"} <= set(metrics)
    assert torch.isfinite(metrics["train/loss"]) and model.real_tokens_seen > 0
    # The token counts are logged under CausalLM's names too: the running count is this rank's counter.
    assert metrics["train/real_tokens_seen"] == model.real_tokens_seen
    assert 0 < metrics["train/real_token_fraction"] <= 1 and "train/token_efficiency" in metrics
    # The reference stays where setup copied it; the policy moved.
    moved = [not torch.equal(p, r) for p, r in zip(model.model.parameters(), model.reference_model.parameters())]
    assert any(moved) and not any(p.requires_grad for p in model.reference_model.parameters())


def test_dpo_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"reference='frozen' is not valid; use one of \('copy', 'precomputed'\)"):
        DPO(model_config=TINY, reference="frozen")


def test_dpo_with_precomputed_reference_logps_needs_no_copy(tmp_path):
    rows = [
        {
            "prompt_ids": [5 + i % 7, 6],
            "chosen_ids": [7, 8 + i % 5],
            "rejected_ids": [9 + i % 3],
            "ref_chosen_logps": -3.0 - i % 4,
            "ref_rejected_logps": -2.5,
        }
        for i in range(24)
    ]
    dm = SeqMemDataModule(
        datasets.Dataset.from_list(rows),
        max_length=16,
        micro_batch_size=4,
        pad_token_id=0,
        cache_dir=tmp_path,
        strategy="pack",
    )
    batch = next(iter(dm.train_dataloader()))
    pairs = (int(batch["sequence_index"].max()) + 1) // 2  # sequences 0..P-1 chosen, P..2P-1 rejected
    assert batch["ref_chosen_logps"].shape == (pairs,) and batch["ref_chosen_logps"].dtype == torch.float32
    model = DPO(model_config=TINY, vocab_size=32, reference="precomputed")
    quiet_trainer(max_steps=2, limit_val_batches=1).fit(model, datamodule=dm)
    assert model.reference_model is None and torch.isfinite(model.trainer.callback_metrics["train/loss"])


@pytest.mark.parametrize(
    "batching", [{"batching": Pad()}, {"batching": Pack()}, {"batching": Pad(), "max_tokens_per_batch": 160}]
)
def test_dpo_on_a_mix_of_preference_pairs_logs_each_sources_validation_loss(tmp_path, batching):
    """A ``Mix`` of preference pairs through DPO: its training batches are shaped as one source's (``micro_batch_size``
    pairs, or what the token budget holds: a padded pair once counted as one row where it is two), each validation
    batch says its source (a packed row of pairs is a list, which once failed where a ``"source"`` key was added to
    every row), and DPO logs ``val/loss/<name>``, the mean DPO loss over that source's validation pairs."""
    from lightning_seqmem import Mix
    from lightning_seqmem.batch import SOURCE_INDEX

    rows = text_rows(48)
    other = [dict(r, chosen=r["chosen"].upper()) for r in rows]
    mix = Mix({"plain": splits(rows), "loud": splits(other)}, {"plain": 0.5, "loud": 0.5})
    dm = module(mix, tmp_path, **batching)
    alone = module(splits(rows), tmp_path / "alone", **batching)
    shapes = {tuple(b["input_ids"].shape) for b in dm.train_dataloader()}
    assert max(r for r, _ in shapes) == max(b["input_ids"].shape[0] for b in alone.train_dataloader())
    assert all(r * n <= batching.get("max_tokens_per_batch", r * n) for r, n in shapes)
    model = DPO(model_config=TINY, learning_rate=1e-2)
    trainer = quiet_trainer(max_steps=2, val_check_interval=2, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    logged = trainer.callback_metrics
    # each source's loss again, by hand: the weights the fit ended with, pair by pair
    sums, pairs = {"plain": 0.0, "loud": 0.0}, {"plain": 0, "loud": 0}
    model.eval()
    with torch.no_grad():
        for batch in dm.val_dataloader():
            name = dm.source_names()[int(batch[SOURCE_INDEX][0])]
            loss, _ = model.pair_loss(batch)
            n = model._source_loss_weight(batch).item()
            sums[name], pairs[name] = sums[name] + float(loss) * n, pairs[name] + n
    assert pairs == {"plain": 8, "loud": 8}
    for name in sums:
        assert float(logged[f"val/loss/{name}"]) == pytest.approx(sums[name] / pairs[name], rel=1e-4)
