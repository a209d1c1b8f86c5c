"""Tests for the ``SeqLengthWarmup`` callback in a real Lightning ``Trainer`` (CPU, tiny Llama)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from _forked_ranks import run_ranks
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, IterableDataset
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_seqmem import SeqLengthWarmup
from lightning_seqmem.batching.options import Pack, as_batching
from lightning_seqmem.warmup import seq_length_at

VOCAB, PAD, LENGTH, ROWS = 128, 0, 64, 4


# ----------------------------------------------------------------------------------------------- fixtures


def documents(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(LENGTH // 2, LENGTH + 1, (n,), generator=gen)
    lengths[::ROWS] = LENGTH  # every batch has a full-length row, so batches are [ROWS, LENGTH] before the cut
    return [torch.randint(1, VOCAB, (int(k),), generator=gen).tolist() for k in lengths]


def pad_collate(docs: list[list[int]]) -> dict[str, torch.Tensor]:
    longest = max(len(d) for d in docs)
    ids = torch.full((len(docs), longest), PAD)
    mask = torch.zeros_like(ids)
    for i, d in enumerate(docs):
        ids[i, : len(d)], mask[i, : len(d)] = torch.tensor(d), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def loader(n_batches: int, seed: int = 0) -> DataLoader:
    return DataLoader(documents(n_batches * ROWS, seed), batch_size=ROWS, collate_fn=pad_collate, shuffle=False)


class TinyLM(LightningModule):
    """A tiny Llama that records what each training/validation step saw (to files, so DDP ranks can report)."""

    def __init__(self, record_dir: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            pad_token_id=PAD,
            attn_implementation="sdpa",
        )
        self.model = LlamaForCausalLM(config)
        self.record_dir = record_dir
        self.train_seen: list[dict] = []
        self.val_lengths: list[int] = []
        self.real_tokens = 0

    def training_step(self, batch, batch_idx):
        rows, seq = batch["input_ids"].shape
        self.real_tokens += int(batch["attention_mask"].sum())
        warmup = next((c for c in self.trainer.callbacks if isinstance(c, SeqLengthWarmup)), None)
        record = {
            "step": self.trainer.global_step,
            "rows": rows,
            "seq": seq,
            "real": self.real_tokens,
            "tokens_seen": warmup.tokens_seen if warmup is not None else None,
        }
        self.train_seen.append(record)
        if self.record_dir is not None:
            with open(Path(self.record_dir) / f"rank{self.global_rank}.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "labels") if k in batch}
        return self.model(**inputs, use_cache=False).loss

    def validation_step(self, batch, batch_idx):
        self.val_lengths.append(batch["input_ids"].shape[1])
        return self.model(**batch, use_cache=False).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def trainer(tmp_path: Path, callbacks: list[Callback], **kwargs) -> Trainer:
    options = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "default_root_dir": tmp_path,
        "deterministic": True,
    } | kwargs
    return Trainer(callbacks=callbacks, **options)


def expected(step: int, total: int, warmup: SeqLengthWarmup) -> int:
    return seq_length_at(
        step,
        total,
        warmup.duration,
        warmup.min_seq_length,
        warmup.max_seq_length,
        warmup.step_size,
        warmup.curve,
        warmup.root_degree,
    )


# ---------------------------------------------------------------------------------------- schedule in fit


def test_accumulation_lengths_follow_schedule_and_validation_is_full_length(tmp_path):
    seed_everything(0)
    warmup = SeqLengthWarmup(duration=0.75, min_seq_length=8, max_seq_length=LENGTH, step_size=8)
    model = TinyLM()
    t = trainer(tmp_path, [warmup], max_epochs=2, accumulate_grad_batches=2, limit_val_batches=2)
    t.fit(model, loader(8), loader(2, seed=1))
    total = 8  # 2 epochs x 8 micro-batches / 2
    seen = model.train_seen
    assert [r["step"] for r in seen] == [s for s in range(total) for _ in range(2)]
    assert [r["seq"] for r in seen] == [expected(r["step"], total, warmup) for r in seen]
    assert seen[0]["seq"] == 8 and seen[-1]["seq"] == LENGTH
    assert all(r["rows"] == ROWS for r in seen)
    assert set(model.val_lengths) == {LENGTH}
    # tokens_seen counts what the model trained on, after the cut
    assert warmup.tokens_seen == model.real_tokens == seen[-1]["real"]
    metrics = t.callback_metrics
    assert metrics["seq_length_warmup/seq_len"] == LENGTH
    assert metrics["seq_length_warmup/rows"] == ROWS
    assert metrics["seq_length_warmup/tokens_seen"] == model.real_tokens


def test_reshape_mode_makes_more_rows(tmp_path):
    seed_everything(0)
    warmup = SeqLengthWarmup(duration=0.5, min_seq_length=16, max_seq_length=LENGTH, step_size=16, truncate=False)
    model = TinyLM()
    trainer(tmp_path, [warmup], limit_val_batches=0).fit(model, loader(6))
    for r in model.train_seen:
        seq = expected(r["step"], 6, warmup)
        assert r["seq"] == seq
        assert r["rows"] <= ROWS * LENGTH // seq
    assert model.train_seen[0]["rows"] > ROWS
    raw_tokens = sum(len(d) for d in documents(6 * ROWS))
    assert raw_tokens - model.real_tokens <= 6 * 15  # at most curr - 1 tokens dropped per batch
    assert warmup.max_warmup_shape(ROWS, LENGTH) == (ROWS, LENGTH)


class Tokens(IterableDataset):
    def __iter__(self):
        yield from documents(6 * ROWS)


def test_unsized_loader_needs_max_steps_or_token_budget(tmp_path):
    unsized = DataLoader(Tokens(), batch_size=ROWS, collate_fn=pad_collate)
    warmup = SeqLengthWarmup(max_seq_length=LENGTH)
    with pytest.raises(MisconfigurationException, match=r"max_steps=.*total_tokens="):
        trainer(tmp_path, [warmup], limit_val_batches=0).fit(TinyLM(), unsized)


def test_unsized_loader_is_fine_when_warmup_is_off(tmp_path):
    unsized = DataLoader(Tokens(), batch_size=ROWS, collate_fn=pad_collate)
    model = TinyLM()
    with pytest.warns(UserWarning, match="got a training batch of 64 tokens per row"):  # 32 of them, on purpose
        trainer(tmp_path, [SeqLengthWarmup(duration=0, max_seq_length=32)], limit_val_batches=0).fit(model, unsized)
    assert {r["seq"] for r in model.train_seen} == {32}


def test_token_budget_schedule(tmp_path):
    seed_everything(0)
    unsized = DataLoader(Tokens(), batch_size=ROWS, collate_fn=pad_collate)
    warmup = SeqLengthWarmup(duration=1.0, min_seq_length=8, max_seq_length=LENGTH, total_tokens=300)
    model = TinyLM()
    trainer(tmp_path, [warmup], limit_val_batches=0).fit(model, unsized)
    before = 0
    for r in model.train_seen:  # each step's length follows the tokens trained on before it
        assert r["seq"] == expected(before, 300, warmup)
        before = r["real"]
    assert model.train_seen[0]["seq"] == 8 and model.train_seen[-1]["seq"] == LENGTH
    assert warmup.tokens_seen == model.real_tokens


def test_non_dict_batch_is_a_clear_error(tmp_path):
    class ListLM(TinyLM):
        def training_step(self, batch, batch_idx):
            raise AssertionError("unreachable")

    tuples = DataLoader([torch.zeros(8, dtype=torch.long)] * 4, batch_size=2)
    with pytest.raises(TypeError, match="collate_fn"):
        trainer(tmp_path, [SeqLengthWarmup(max_seq_length=8)], limit_val_batches=0).fit(ListLM(), tuples)


# -------------------------------------------------------------------------------------------------- resume


def test_resume_mid_warmup_matches_uninterrupted_run(tmp_path):
    def run(ckpt_path=None, checkpoint_dir=None):
        seed_everything(0)
        warmup = SeqLengthWarmup(duration=0.75, min_seq_length=8, max_seq_length=LENGTH, step_size=8)
        callbacks: list[Callback] = [warmup]
        if checkpoint_dir is not None:
            callbacks.append(
                ModelCheckpoint(dirpath=checkpoint_dir, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
            )
        model = TinyLM()
        t = trainer(
            tmp_path,
            callbacks,
            max_epochs=4,
            accumulate_grad_batches=2,
            limit_val_batches=0,
            enable_checkpointing=checkpoint_dir is not None,
        )
        t.fit(model, loader(4), ckpt_path=ckpt_path)
        return model, warmup

    full, full_warmup = run(checkpoint_dir=tmp_path / "ckpt")
    resumed, resumed_warmup = run(ckpt_path=str(tmp_path / "ckpt" / "epoch=1.ckpt"))
    # 8 optimizer steps, warmup for 6; the checkpoint is at step 4, mid-warmup
    assert [r["step"] for r in resumed.train_seen][0] == 4
    assert len({r["seq"] for r in resumed.train_seen}) > 1
    assert [(r["step"], r["seq"]) for r in resumed.train_seen] == [
        (r["step"], r["seq"]) for r in full.train_seen if r["step"] >= 4
    ]
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert resumed_warmup.tokens_seen == full_warmup.tokens_seen


# ----------------------------------------------------------------------------------------------------- DDP


def _fit_on_rank(rank: int, tmp_path: Path, warmup: SeqLengthWarmup) -> None:
    """One of two forked ranks (``_forked_ranks``) under Lightning's DDP; each writes ``rank<r>.jsonl``."""
    model = TinyLM(record_dir=str(tmp_path))
    t = trainer(
        tmp_path,
        [warmup],
        strategy="ddp",
        devices=2,
        accumulate_grad_batches=2,
        limit_val_batches=0,
        deterministic=False,
    )
    t.fit(model, loader(12))  # 6 batches per rank, 3 optimizer steps
    assert t.global_rank == rank


@pytest.mark.slow
def test_ddp_ranks_see_the_same_length(tmp_path):
    warmup = SeqLengthWarmup(duration=0.75, min_seq_length=8, max_seq_length=LENGTH, step_size=8)
    run_ranks(_fit_on_rank, tmp_path, warmup)
    ranks = [[json.loads(line) for line in open(tmp_path / f"rank{r}.jsonl")] for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 6
    steps = [[(r["step"], r["seq"]) for r in rank] for rank in ranks]
    assert steps[0] == steps[1]
    assert [seq for _, seq in steps[0]] == [expected(step, 3, warmup) for step, _ in steps[0]]
    assert len({seq for _, seq in steps[0]}) > 1
    # tokens_seen is summed over both ranks at every optimizer step, so it is the same number on both ranks
    for i in range(0, 6, 2):  # first micro-batch of each accumulation window
        before = [rank[i - 1]["real"] if i else 0 for rank in ranks]
        assert ranks[0][i]["tokens_seen"] == ranks[1][i]["tokens_seen"] == sum(before)


# ------------------------------------------------------------------------------------ checks and reporting


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"duration": 1.2}, ValueError, r"\[0, 1\]"),
        ({"min_seq_length": 0}, ValueError, "min_seq_length must be >= 1"),
        ({"min_seq_length": 128, "max_seq_length": 64}, ValueError, "must be <= max_seq_length"),
        ({"step_size": 0}, ValueError, "step_size must be >= 1"),
        ({"truncate": False, "preserve_end_of_sequence": True}, ValueError, "truncate=True"),
        ({"total_tokens": 0}, ValueError, "total_tokens"),
        ({"curve": "cosine"}, ValueError, "fixed_root"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        SeqLengthWarmup(**kwargs)


def test_step_size_not_multiple_of_8_warns():
    with pytest.warns(UserWarning, match="multiples of 8"):
        SeqLengthWarmup(step_size=6)


def test_max_warmup_shape():
    truncate = SeqLengthWarmup(min_seq_length=8, max_seq_length=64)
    assert truncate.max_warmup_shape(4, 128) == (4, 64)
    assert truncate.max_warmup_shape(4, 32) == (4, 32)
    reshape = SeqLengthWarmup(min_seq_length=8, max_seq_length=64, truncate=False)
    assert reshape.max_warmup_shape(4, 64) == (4, 64)
    assert reshape.max_warmup_shape(4, 100) == (10, 40)  # 400 tokens; (6, 64) holds only 384
    assert (32, 8) in reshape.batch_shapes(4, 64)
    assert SeqLengthWarmup(duration=0, max_seq_length=64, truncate=False).batch_shapes(4, 64) == [(4, 64)]


class ShapeDataModule(LightningDataModule):
    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length

    def train_dataloader(self):
        return loader(2)

    def max_batch_shape(self) -> tuple[int, int]:
        return ROWS, self.length


@pytest.mark.parametrize(
    ("max_seq_length", "match"), [(128, "longer than the longest batch"), (32, "shorter than the DataModule")]
)
def test_max_seq_length_mismatch_reported_once(tmp_path, max_seq_length, match):
    warmup = SeqLengthWarmup(max_seq_length=max_seq_length, min_seq_length=8)
    with pytest.warns(UserWarning, match=match) as record:
        trainer(tmp_path, [warmup], limit_val_batches=0).fit(TinyLM(), datamodule=ShapeDataModule(LENGTH))
    assert sum("SeqLengthWarmup(max_seq_length" in str(w.message) for w in record) == 1


def test_long_batches_without_datamodule_reported_once(tmp_path):
    warmup = SeqLengthWarmup(max_seq_length=32, min_seq_length=8)
    with pytest.warns(UserWarning, match="got a training batch of 64 tokens") as record:
        trainer(tmp_path, [warmup], limit_val_batches=0).fit(TinyLM(), loader(3))
    assert sum("SeqLengthWarmup(max_seq_length" in str(w.message) for w in record) == 1


def test_matching_datamodule_is_silent(tmp_path):
    warmup = SeqLengthWarmup(max_seq_length=LENGTH, min_seq_length=8)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer(tmp_path, [warmup], limit_val_batches=0).fit(TinyLM(), datamodule=ShapeDataModule(LENGTH))
    assert not [w for w in record if "SeqLengthWarmup" in str(w.message)]


# --------------------------------------------------------------------- with CausalLM and SeqMemDataModule

TINY = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


@pytest.mark.parametrize(("strategy", "truncate"), [("pad", True), ("pack", False)])
def test_with_causal_lm_and_datamodule(tmp_path, strategy, truncate):
    from lightning_seqmem import CausalLM, SeqMemDataModule

    class RecordingLM(CausalLM):
        def training_step(self, batch, batch_idx):
            self.shapes = [*getattr(self, "shapes", []), (self.trainer.global_step, *batch["input_ids"].shape)]
            if "cu_seqlens" in batch:  # recomputed after the cut: one boundary per position restart
                assert batch["cu_seqlens"][-1] == batch["input_ids"].numel()
                assert len(batch["cu_seqlens"]) - 1 == int((batch["position_ids"] == 0).sum())
            return super().training_step(batch, batch_idx)

    seed_everything(0)
    batching = Pack(cu_seqlens=True) if strategy == "pack" else as_batching(strategy)
    dm = SeqMemDataModule(max_length=64, micro_batch_size=4, batching=batching)
    warmup = SeqLengthWarmup(duration=0.5, min_seq_length=8, max_seq_length=64, step_size=8, truncate=truncate)
    model = RecordingLM(model_config=TINY)
    t = trainer(tmp_path, [warmup], max_steps=8, limit_val_batches=2, val_check_interval=8)
    t.fit(model, datamodule=dm)
    lengths = [seq for _, _, seq in model.shapes]
    assert lengths == [expected(step, 8, warmup) for step, _, _ in model.shapes]
    assert lengths[0] == 8 and lengths[-1] == 64
    if not truncate:
        assert model.shapes[0][1] > 4  # more rows of fewer tokens
    # the model and the callback count the same real tokens: those left after the cut
    assert warmup.tokens_seen == model.real_tokens_seen
    assert torch.isfinite(t.callback_metrics["val/loss"])
    assert warmup.max_warmup_shape(*dm.max_batch_shape()) == (4, 64)


def test_min_seq_length_above_the_longest_batch_is_reported_once_with_the_figures(tmp_path):
    """Rows of at most 64 tokens and a warmup that starts at 96: nothing is ever cut; one warning says so."""
    warmup = SeqLengthWarmup(min_seq_length=96, max_seq_length=128)
    model = TinyLM()
    with pytest.warns(UserWarning, match=r"min_seq_length=96\) starts at or above .*\(64 tokens per row\)") as record:
        trainer(tmp_path, [warmup], limit_val_batches=0).fit(model, datamodule=ShapeDataModule(LENGTH))
    assert sum("SeqLengthWarmup" in str(w.message) for w in record) == 1  # not also the max_seq_length warning
    assert {r["seq"] for r in model.train_seen} == {LENGTH}  # what it says: nothing was cut


def test_max_steps_zero_says_the_run_trains_nothing(tmp_path):
    warmup = SeqLengthWarmup(max_seq_length=LENGTH)
    model = TinyLM()
    with pytest.warns(UserWarning, match=r"no optimizer step \(Trainer\(max_steps=0, .*fit trains nothing"):
        trainer(tmp_path, [warmup], limit_val_batches=0, max_steps=0).fit(model, datamodule=ShapeDataModule(LENGTH))
    assert model.train_seen == []


def test_min_seq_length_above_every_batch_without_a_datamodule_is_reported_when_warmup_ends(tmp_path):
    """A plain loader (no DataModule to ask): rows of at most 64 tokens, warmup from 96; said once, at its end."""
    warmup = SeqLengthWarmup(duration=0.5, min_seq_length=96, max_seq_length=128)
    model = TinyLM()
    with pytest.warns(UserWarning, match=r"ended without cutting a batch: .* 64 tokens per row, .*min_seq_length=96"):
        trainer(tmp_path, [warmup], limit_val_batches=0).fit(model, loader(4))
    assert {r["seq"] for r in model.train_seen} == {LENGTH}
