"""Loading datasets: files, globs, lists of files, documents or rows; bad files named with their line."""

import json

import pytest
from omegaconf import OmegaConf

from lightning_seqmem.data.local_files import json_problem
from lightning_seqmem.data.sources import load_text_dataset
from lightning_seqmem.messages import short_repr


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_malformed_jsonl_line_names_file_line_and_problem(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "no closing brace"\n{"text": "fine"}\n')
    with pytest.raises(ValueError, match=r"train\.jsonl, line 2, column \d+: invalid JSON") as err:
        load_text_dataset(str(path))
    assert "one complete object per line" in str(err.value)


def test_jsonl_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "fine"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"rows\.jsonl, line 2: a JSON list, not an object"):
        load_text_dataset(str(path))
    assert json_problem(str(write_jsonl(tmp_path / "ok.jsonl", ["a", "b"]))) is None


@pytest.mark.parametrize("content", ["", "  \n\n"])
def test_empty_file_is_named(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"empty\.jsonl is empty: there are no rows"):
        load_text_dataset(str(path))


def test_malformed_csv_names_the_file(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text('text\n"a"\n"b","extra","fields"\n')
    with pytest.raises(ValueError, match=r"Could not read .*bad\.csv: "):
        load_text_dataset(str(path))


def test_list_of_strings_is_documents(tmp_path):
    texts = [f"document {i}: " + "words " * i for i in range(50)]
    dsd = load_text_dataset(texts)
    assert dsd["train"]["text"] == texts
    rows = load_text_dataset([{"text": "a", "id": 1}, {"text": "b", "id": 2}])  # dicts are rows
    assert rows["train"].column_names == ["text", "id"] and rows["train"]["text"] == ["a", "b"]


def test_list_of_existing_paths_and_globs_is_files(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", ["one", "two"])
    write_jsonl(tmp_path / "b.jsonl", ["three"])
    assert len(load_text_dataset([str(a), str(tmp_path / "b.jsonl")])["train"]) == 3
    assert len(load_text_dataset([str(tmp_path / "*.jsonl")])["train"]) == 3
    assert len(load_text_dataset(OmegaConf.create([str(a)]))["train"]) == 2  # data.dataset=[...] from Hydra


def test_missing_files_in_a_list_are_an_error_not_documents(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", ["one"])
    with pytest.raises(FileNotFoundError, match=r"1 of them name existing files, 1 do not \(first: '.*typo\.jsonl'\)"):
        load_text_dataset([str(a), str(tmp_path / "typo.jsonl")])
    with pytest.raises(FileNotFoundError, match="list of file names, none of which exists"):
        load_text_dataset(["data/train.jsonl", "data/valid.jsonl"])


def test_messages_never_echo_unbounded_data(tmp_path):
    names = [f"missing_{i:05d}_" + "x" * 200 + ".jsonl" for i in range(2000)]  # ~420 KB of file names
    with pytest.raises(FileNotFoundError) as err:
        load_text_dataset(names)
    assert len(str(err.value)) < 400
    with pytest.raises(FileNotFoundError) as err:
        load_text_dataset("/no/such/" + "y" * 5000 + ".jsonl")
    assert len(str(err.value)) < 400
    assert len(short_repr(["z" * 10_000] * 1000)) < 300


@pytest.mark.parametrize(
    "bad,error,match",
    [
        ([], ValueError, "empty list"),
        ([1, "a"], TypeError, "list of int, str"),
        (None, ValueError, "No dataset given"),
    ],
)
def test_bad_lists_and_none(bad, error, match):
    with pytest.raises(error, match=match):
        load_text_dataset(bad)


def test_datamodule_trains_on_a_list_of_documents():
    from lightning_seqmem import SeqMemDataModule

    texts = [f"document {i}: " + "lorem ipsum " * (1 + i % 5) for i in range(40)]
    dm = SeqMemDataModule(dataset=texts, max_length=32, micro_batch_size=4)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 4


@pytest.mark.parametrize("form", ["plain", "shuffled", "numpy_format"])
def test_select_rows_is_select_without_python_lists(form):
    import datasets as hf
    import numpy as np

    from lightning_seqmem.data.sources import select_rows

    ds = hf.Dataset.from_dict({"input_ids": [[i] * (i % 4) for i in range(60)], "n": list(range(60))})
    ds = {
        "plain": ds,
        "shuffled": ds.shuffle(seed=1),
        "numpy_format": ds.with_format("numpy", columns=["n"], output_all_columns=True),
    }[form]
    rows = np.random.default_rng(0).permutation(len(ds))[:25]
    got, want = select_rows(ds, rows, "test"), ds.select(rows)
    assert got.format == want.format and len(got) == 25
    assert [int(v) for v in got["n"]] == [int(v) for v in want["n"]]
    assert [list(map(int, r)) for r in got["input_ids"]] == [list(map(int, r)) for r in want["input_ids"]]
    assert got._fingerprint != ds._fingerprint
    assert select_rows(ds, rows[:5], "test")._fingerprint != got._fingerprint
    with pytest.raises(IndexError, match=r"\[0, 60\)"):
        select_rows(ds, np.array([3, 60]), "test")


def test_pandas_data_frame_is_a_dataset():
    """A DataFrame reaches neither Lightning's save_hyperparameters (its elementwise ``==`` raised "Unable to coerce
    to Series") nor a TypeError: its columns are the dataset's, as from a list of rows."""
    import pandas as pd

    from lightning_seqmem import SeqMemDataModule

    texts = [f"document number {i} with some words" for i in range(40)]
    frame = pd.DataFrame({"text": texts}, index=range(100, 140))
    dm = SeqMemDataModule(dataset=frame, max_length=32, micro_batch_size=4)
    assert "dataset" not in dm.hparams and "tokenizer" not in dm.hparams
    assert load_text_dataset(frame)["train"].column_names == ["text"]  # the index is not a column
    dm.setup("fit")
    same = SeqMemDataModule(dataset=texts, max_length=32, micro_batch_size=4)
    same.setup("fit")
    assert dm.stats() == same.stats()
    assert next(iter(dm.train_dataloader()))["input_ids"].tolist() == (
        next(iter(same.train_dataloader()))["input_ids"].tolist()
    )
