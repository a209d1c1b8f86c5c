"""Tokenize once per node: prepare_data (local rank 0) tokenizes, every rank's setup reads the cache; a different
tokenizer (content, not name) tokenizes again; setup alone (no prepare_data) still works."""

import os

import datasets
import lightning.pytorch as L
import torch
from transformers import PreTrainedTokenizerFast

from lightning_seqmem.datamodule import SeqMemDataModule
from lightning_seqmem.token_cache import default_cache_dir, tokenizer_fingerprint


class CountingTokenizer(PreTrainedTokenizerFast):
    """A real fast tokenizer that appends its process id to ``marker`` on every call (works across processes)."""

    marker: str | None = None

    def __call__(self, *args, **kwargs):
        with open(self.marker, "a") as f:
            f.write(f"{os.getpid()}\n")
        return super().__call__(*args, **kwargs)


def _counting(tokenizer, tmp_path, name, extra_token=None):
    path = tmp_path / name
    tokenizer.save_pretrained(path)
    tok = CountingTokenizer.from_pretrained(path)
    if extra_token:
        tok.add_tokens([extra_token])
    tok.marker = str(tmp_path / f"{name}.calls")
    return tok


def _calls(tok):
    return open(tok.marker).read().split() if os.path.exists(tok.marker) else []


def _data():
    return datasets.Dataset.from_dict({"text": [f"doc {i} " + "alpha beta " * (1 + i % 9) for i in range(48)]})


class _Steps(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        return (self.w * batch["input_ids"].float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_two_ranks_tokenize_once_and_a_new_tokenizer_invalidates_the_cache(tmp_path, tokenizer):
    tok = _counting(tokenizer, tmp_path, "tok")
    cache = tmp_path / "cache"
    dm = SeqMemDataModule(dataset=_data(), tokenizer=tok, strategy="pack", max_length=32, micro_batch_size=2,
                          cache_dir=cache, num_proc=1)
    trainer = L.Trainer(strategy="ddp_spawn", devices=2, accelerator="cpu", max_steps=2, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(_Steps(), datamodule=dm)
    calls = _calls(tok)
    assert calls and len(set(calls)) == 1  # one process tokenized (local rank 0 in prepare_data); rank 1 read
    assert len(list((cache / "tokenized").iterdir())) == 1  # one cached split (validation is carved out later)

    again = SeqMemDataModule(dataset=_data(), tokenizer=tok, strategy="pack", max_length=32, cache_dir=cache)
    again.setup("fit")  # no prepare_data: setup finds the cache on its own
    assert _calls(tok) == calls

    other = _counting(tokenizer, tmp_path, "other", extra_token="alpha")  # same name and class, other content
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tok)
    changed = SeqMemDataModule(dataset=_data(), tokenizer=other, strategy="pack", max_length=32, cache_dir=cache)
    changed.setup("fit")
    assert _calls(other) and len(list((cache / "tokenized").iterdir())) == 2
    assert changed.stats()["train"]["tokens"] < again.stats()["train"]["tokens"]  # "alpha" is one token now


def test_setup_alone_tokenizes_and_num_proc_gives_the_same_tokens(tmp_path, tokenizer):
    ids = {}
    for procs in (1, 2):
        dm = SeqMemDataModule(dataset=_data(), tokenizer=tokenizer, cache_dir=tmp_path / f"c{procs}", num_proc=procs,
                              max_length=512)
        dm.setup("fit")  # plain Python use: no prepare_data
        ids[procs] = [r.tolist() for r in (dm._rows["train"][i]["input_ids"] for i in range(len(dm._rows["train"])))]
    assert ids[1] == ids[2] and len(ids[1]) > 0


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "lightning_seqmem"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir().parts[-2:] == (".cache", "lightning_seqmem")
