"""Resuming a mid-epoch checkpoint with other data: refused by default (naming what changed), or the epoch restarts."""

import pytest
from _recorder import fit_recording

from lightning_seqmem import SeqMemDataModule


def test_resume_with_another_max_length_is_refused_naming_the_change(small_text_dataset, tmp_path):
    fit_recording(tmp_path, 3, save=True, dataset=small_text_dataset)
    ckpt = str(tmp_path / "epoch=0-step=3.ckpt")
    with pytest.raises(ValueError, match=r"max_length: 32 -> 16.*on_resume_mismatch='restart_epoch'"):
        fit_recording(tmp_path, 6, ckpt=ckpt, dataset=small_text_dataset, max_length=16)
    with pytest.raises(ValueError, match=r"batching: Pack\(method='bfd', overflow='split'\) -> Pad\(\)"):
        fit_recording(tmp_path, 6, ckpt=ckpt, dataset=small_text_dataset, strategy="pad")
    other = small_text_dataset.select(range(1, len(small_text_dataset)))  # another dataset, same settings
    with pytest.raises(ValueError, match="Cannot resume the data position"):
        fit_recording(tmp_path, 6, ckpt=ckpt, dataset=other)


def test_resume_with_the_same_data_still_replays_exactly(small_text_dataset, tmp_path):
    full, _ = fit_recording(tmp_path / "full", 6, dataset=small_text_dataset)
    fit_recording(tmp_path, 3, save=True, dataset=small_text_dataset)
    resumed, _ = fit_recording(tmp_path, 6, ckpt=str(tmp_path / "epoch=0-step=3.ckpt"), dataset=small_text_dataset)
    assert resumed == full[3:]


def test_restart_epoch_starts_the_new_rows_from_their_first_batch(small_text_dataset, tmp_path):
    fit_recording(tmp_path, 3, save=True, dataset=small_text_dataset)
    fresh, dm = fit_recording(tmp_path / "fresh", 2, dataset=small_text_dataset, max_length=16)
    with pytest.warns(UserWarning, match="the current epoch restarts from its first batch"):
        resumed, _ = fit_recording(
            tmp_path,
            5,
            ckpt=str(tmp_path / "epoch=0-step=3.ckpt"),
            dataset=small_text_dataset,
            max_length=16,
            on_resume_mismatch="restart_epoch",
        )
    assert resumed[:2] == fresh  # epoch 0 of the new rows from its start, not from the old position
    assert all(len(row) == 16 for batch in resumed for row in batch)


def test_on_resume_mismatch_is_validated():
    with pytest.raises(ValueError, match="on_resume_mismatch='skip' is not valid"):
        SeqMemDataModule(on_resume_mismatch="skip")
