"""Lightning's own tools on a ``SeqMemDataModule``, used as a Lightning user meets them (issue 30): the batch-size
finder, ``trainer.test``/``trainer.predict``, a user's LightningModule logged with the DataModule, and the
DataModule's Python defaults. A real Trainer on CPU, the tiny model, a few steps."""

import math

import datasets
import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.tuner import Tuner

from lightning_seqmem import CausalLM, Pack, SeqMemDataModule


def _texts(n: int, tag: str) -> list[str]:
    return [f"{tag} document {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 5) for i in range(n)]


def _trainer(tmp_path, **kwargs) -> L.Trainer:
    options = dict(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        default_root_dir=tmp_path,
    )
    return L.Trainer(**{**options, **kwargs})


class _Rows(L.Callback):
    """Rows of every training batch."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.rows.append(batch["input_ids"].shape[0])


@pytest.mark.parametrize("batch_arg_name", ["micro_batch_size", None])
def test_batch_size_finder_scales_micro_batch_size(tmp_path, batch_arg_name):
    """``Tuner.scale_batch_size(..., batch_arg_name="micro_batch_size")`` sets the DataModule's micro-batch (was:
    "property has no setter"), and so does the call with Lightning's default name, ``batch_size`` (was: "Field
    batch_size not found"); every later loader, ``stats()`` and the fit that follows use it."""
    data = datasets.Dataset.from_dict({"text": _texts(64, "train")})
    dm = SeqMemDataModule(data, strategy="pad", max_length=32, micro_batch_size=2, cache_dir=tmp_path / "cache")
    rows = _Rows()
    trainer = _trainer(tmp_path, callbacks=[rows])
    model = CausalLM(model_config="tiny_llama")
    found = Tuner(trainer).scale_batch_size(
        model,
        datamodule=dm,
        mode="power",
        init_val=2,
        max_trials=3,
        steps_per_trial=1,
        **({"batch_arg_name": batch_arg_name} if batch_arg_name else {}),
    )
    assert found == 8 and dm.micro_batch_size == 8 and dm.hparams["micro_batch_size"] == 8
    assert next(iter(dm.train_dataloader()))["input_ids"].shape[0] == 8
    assert dm.settings.batching.micro_batch_size == 8 and dm.eval_batch_size == 8  # unset eval_batch_size follows
    assert dm.stats()["train"]["batches"] == math.ceil(dm.stats()["train"]["rows"] / 8)
    trainer = _trainer(tmp_path, callbacks=[rows])
    trainer.fit(model, datamodule=dm)
    assert rows.rows == [8, 8]
    with pytest.raises(ValueError, match="micro_batch_size"):
        dm.micro_batch_size = 0  # checked as in __init__


def _with_test_split(tmp_path, **kwargs) -> SeqMemDataModule:
    data = datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"text": _texts(24, "train")}),
        validation=datasets.Dataset.from_dict({"text": _texts(6, "validation")}),
        test=datasets.Dataset.from_dict({"text": _texts(10, "test") + [""]}),  # an empty one, skipped and counted
    )
    return SeqMemDataModule(data, max_length=128, micro_batch_size=4, cache_dir=tmp_path / "cache", **kwargs)


@pytest.mark.parametrize("strategy", ["pad", "pack"])
def test_trainer_test_and_predict_serve_the_test_split(tmp_path, strategy):
    """A ``test`` split is served to ``trainer.test`` (and counted in ``stats()``) and to ``trainer.predict`` (was:
    no loader; the split was tokenized and never read)."""
    dm = _with_test_split(tmp_path, strategy=strategy)
    model = CausalLM(model_config="tiny_llama")
    results = _trainer(tmp_path).test(model, datamodule=dm, verbose=False)
    assert math.isfinite(results[0]["test/loss"])
    test = dm.stats()["test"]
    assert test["documents"] == 10 and test["empty_documents_skipped"] == 1 and test["tokens_truncated"] == 0
    test_tokens = sum(len(dm.tokenizer(t)["input_ids"]) for t in _texts(10, "test"))
    assert test["tokens"] >= test_tokens  # the test documents, not the validation ones (plus any EOS)
    predictions = _trainer(tmp_path).predict(model, datamodule=dm)
    assert len(predictions) == test["batches"]
    assert all(torch.isfinite(p.logits).all() for p in predictions)


def test_predict_falls_back_to_validation_and_test_names_the_fix(tmp_path):
    """Without a ``test`` split ``trainer.predict`` serves validation and ``trainer.test`` says what to pass."""
    data = datasets.Dataset.from_dict({"text": _texts(40, "train")})
    dm = SeqMemDataModule(data, max_length=32, micro_batch_size=4, cache_dir=tmp_path / "cache")
    model = CausalLM(model_config="tiny_llama")
    predictions = _trainer(tmp_path).predict(model, datamodule=dm)
    assert len(predictions) == dm.stats()["validation"]["batches"] and "test" not in dm.stats()
    with pytest.raises(ValueError, match=r"needs a 'test' split.*DatasetDict\(train=\.\.\., validation=\.\.\., test"):
        _trainer(tmp_path).test(model, datamodule=dm, verbose=False)


def test_a_stream_serves_its_test_split(tmp_path):
    """A stream with a ``test`` split serves it to ``trainer.test``, counted as it is read."""
    data = datasets.IterableDatasetDict(
        train=datasets.Dataset.from_dict({"text": _texts(24, "train")}).to_iterable_dataset(),
        validation=datasets.Dataset.from_dict({"text": _texts(6, "validation")}).to_iterable_dataset(),
        test=datasets.Dataset.from_dict({"text": _texts(10, "test")}).to_iterable_dataset(),
    )
    dm = SeqMemDataModule(data, strategy="pack", max_length=32, micro_batch_size=4, cache_dir=tmp_path / "cache")
    results = _trainer(tmp_path).test(CausalLM(model_config="tiny_llama"), datamodule=dm, verbose=False)
    assert math.isfinite(results[0]["test/loss"]) and dm.stats()["test"]["documents"] == 10


class _UserLM(L.LightningModule):
    """A user's own model that keeps its pad id as a hyperparameter."""

    def __init__(self, vocab_size: int = 4096, pad_token_id: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = torch.nn.Embedding(vocab_size, 8)
        self.head = torch.nn.Linear(8, vocab_size)

    def training_step(self, batch, batch_idx):
        logits = self.head(self.embed(batch["input_ids"]))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_users_module_with_its_own_pad_token_id_logs_with_the_datamodule(tmp_path):
    """The DataModule logs no ``pad_token_id: None`` that collides with the user's ``pad_token_id=0`` (was:
    "keys ['pad_token_id'] are present in both ... but have different values"); a given pad id is logged."""
    data = datasets.Dataset.from_dict({"text": _texts(40, "train")})
    dm = SeqMemDataModule(data, max_length=32, micro_batch_size=4, cache_dir=tmp_path / "cache")
    model = _UserLM(vocab_size=len(dm.tokenizer))
    logger = CSVLogger(tmp_path, name="csv")
    _trainer(tmp_path, logger=logger, limit_val_batches=0).fit(model, datamodule=dm)
    hparams = (tmp_path / "csv" / "version_0" / "hparams.yaml").read_text().splitlines()
    assert hparams.count("pad_token_id: 0") == 1 and "eos_token_id: null" not in hparams
    assert "pad_token_id" not in dm.hparams_initial and "eos_token_id" not in dm.hparams_initial
    given = SeqMemDataModule(data, pad_token_id=0, eos_token_id=2, cache_dir=tmp_path / "cache")
    assert given.hparams_initial["pad_token_id"] == 0 and given.hparams_initial["eos_token_id"] == 2


def test_the_default_datamodule_loses_no_token_of_the_builtin_corpus():
    """``SeqMemDataModule()`` batches as the main job does (``batching=pack_bfd``): nothing truncated or dropped
    (was: ``Pad()`` at ``max_length=512`` cut 43 % of the built-in corpus's tokens)."""
    dm = SeqMemDataModule()
    assert dm.settings.batching.batching == Pack() and dm.hparams["batching"]["strategy"] == "pack"
    dm.setup("fit")
    for split, stats in dm.stats().items():
        assert stats["tokens"] > 0, split
        assert stats["tokens_truncated"] == 0 and stats["tokens_dropped"] == 0, (split, stats)
