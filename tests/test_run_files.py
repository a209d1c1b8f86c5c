"""The run folder (``apps.run_files``): what its writers (JobRecord, RunSummary, seqmem-train) leave, its reader
(``apps.sweep_jobs``, behind seqmem-report) finds under the same names; RunSummary asks through protocols."""

import json

import lightning.pytorch as L
import pytest
import torch

from lightning_seqmem import CausalLM
from lightning_seqmem.apps import run_files
from lightning_seqmem.apps.job_record import JobRecord
from lightning_seqmem.apps.summary import RunSummary
from lightning_seqmem.apps.sweep_jobs import load_jobs
from lightning_seqmem.apps.train import _write_status
from lightning_seqmem.protocols import CountsTrainingTokens, DescribesBatching


class _Data(L.LightningDataModule):
    """A stand-in DataModule: fixed ``[2, 8]`` batches with 12 real tokens; it describes its batching."""

    def _loader(self):
        ids = torch.ones(4, 8, dtype=torch.long)
        ids[:, 6:] = 0  # 2 pad tokens per row
        rows = [{"input_ids": row, "labels": row, "attention_mask": (row != 0).long()} for row in ids]
        return torch.utils.data.DataLoader(rows, batch_size=2)

    train_dataloader = val_dataloader = _loader

    def batching_label(self) -> str:
        return "pack (stand-in)"

    def constant_shapes(self) -> bool:
        return True

    def packs_documents(self) -> bool:
        return False


class _Model(L.LightningModule):
    """A LightningModule that does not count its tokens: one parameter, logs its losses."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def training_step(self, batch, batch_idx):
        loss = (self.w * batch["input_ids"].float().mean()).sum()
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", (self.w * batch["input_ids"].float().mean()).sum())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _CountingModel(_Model):
    """A stand-in for CausalLM's counters (``protocols.CountsTrainingTokens``), fixed so the summary's sums show."""

    real_tokens_seen = 24
    slots_seen = 32
    train_seconds = 2.0


def _fit(root, model, callbacks):
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=root,
        val_check_interval=1,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        callbacks=callbacks,
    )
    trainer.fit(model, datamodule=_Data())
    return trainer


def test_a_recorded_job_folder_reads_back_through_the_same_names(tmp_path):
    job = tmp_path / "sweep" / "0"
    summary = RunSummary(print_table=False)
    _fit(job, _CountingModel(), [JobRecord(), summary])
    (job / run_files.OVERRIDES_FILE).parent.mkdir()
    (job / run_files.OVERRIDES_FILE).write_text("- data.max_length=8\n")
    _write_status(str(job), run_files.FINISHED)
    assert sorted(p.name for p in job.iterdir() if p.is_file()) == sorted(
        [run_files.PROGRESS_FILE, run_files.TRAIN_PROGRESS_FILE, run_files.SUMMARY_FILE, run_files.JOB_STATUS_FILE]
    )
    assert json.loads((job / run_files.SUMMARY_FILE).read_text()) == pytest.approx(summary.summary)

    [read] = load_jobs(str(tmp_path / "sweep"))
    assert (read.name, read.status, read.finished, read.overrides) == ("0", "finished", True, {"data.max_length": "8"})
    assert [r["step"] for r in read.rows] == [1, 2] and set(read.rows[0]) == set(run_files.PROGRESS_FIELDS)
    assert [r["step"] for r in read.train_rows] == [1, 2]
    assert set(read.train_rows[0]) == set(run_files.TRAIN_PROGRESS_FIELDS)
    assert read.rows[-1]["tokens_seen"] == 2 * 12  # the real tokens of two [2, 8] batches with 4 pads each


def test_run_summary_asks_the_model_and_the_data_through_protocols(tmp_path):
    assert isinstance(_Data(), DescribesBatching) and isinstance(_CountingModel(), CountsTrainingTokens)
    summary = RunSummary(print_table=False)
    _fit(tmp_path, _CountingModel(), [summary])
    got = summary.summary
    assert got["strategy"] == "pack (stand-in)"
    assert (got["real_tokens_trained"], got["slots_fed_to_model"], got["real_token_fraction"]) == (24, 32, 0.75)
    assert got["real_tokens_per_s"] == 12.0  # over the model's own training seconds, not the fit's wall-clock
    assert got["optimizer_steps"] == 2 and "final_val_loss" in got


def test_run_summary_leaves_out_what_nobody_answers(tmp_path):
    summary = RunSummary(print_table=False)
    _fit(tmp_path, _Model(), [summary])
    assert not isinstance(_Model(), CountsTrainingTokens)
    assert not {"real_tokens_trained", "slots_fed_to_model", "real_tokens_per_s"} & set(summary.summary)
    assert summary.summary["optimizer_steps"] == 2


def test_causal_lm_counts_its_training_tokens():
    model = CausalLM(vocab_size=64)
    assert isinstance(model, CountsTrainingTokens)
    assert (model.real_tokens_seen, model.slots_seen, model.train_seconds) == (0, 0, 0.0)
