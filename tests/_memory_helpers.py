"""A tiny Llama LightningModule and DataModule for the memory tests (random weights, no download)."""

from __future__ import annotations

import random

import lightning.pytorch as L
import numpy as np
import torch
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 128


def snapshot(trainer: L.Trainer, model: L.LightningModule) -> dict:
    """Everything the pre-allocation pass must leave untouched."""
    opt = trainer.optimizers[0].state_dict() if trainer.optimizers else {}
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "grads": [p.grad for p in model.parameters()],
        "optimizer": {
            k: {kk: (vv.clone() if torch.is_tensor(vv) else vv) for kk, vv in s.items()}
            for k, s in opt.get("state", {}).items()
        },
        "param_groups": [dict(g) for g in opt.get("param_groups", [])],
        "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
        "global_step": trainer.global_step,
        "python": random.getstate(),
        "numpy": np.random.get_state()[1].copy(),
        "torch": torch.get_rng_state().clone(),
        "training": {n: m.training for n, m in model.named_modules()},
        "metric": (model.train_loss.mean_value.clone(), model.train_loss.weight.clone(), model.train_loss._update_count)
        if hasattr(model, "train_loss")
        else None,
        "counter": getattr(model, "real_tokens_seen", None),
    }


def assert_same(before: dict, after: dict) -> None:
    for key in ("params", "buffers"):
        assert before[key].keys() == after[key].keys()
        for name in before[key]:
            assert torch.equal(before[key][name], after[key][name]), f"{key} {name} changed"
    assert all(g is None for g in after["grads"]), "gradients must be None"
    assert before["optimizer"].keys() == after["optimizer"].keys()
    for k in before["optimizer"]:
        for kk, v in before["optimizer"][k].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(after["optimizer"][k][kk]))
    assert before["param_groups"] == after["param_groups"]
    assert before["schedulers"] == after["schedulers"]
    assert before["global_step"] == after["global_step"]
    assert before["python"] == after["python"]
    assert np.array_equal(before["numpy"], after["numpy"])
    assert torch.equal(before["torch"], after["torch"])
    assert before["training"] == after["training"]
    if before["metric"] is not None:
        pairs = zip(before["metric"], after["metric"])
        assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in pairs)
    assert before["counter"] == after["counter"]


class Probe(L.Callback):
    """Snapshots the run state in on_fit_start; put one before and one after CachePreallocator."""

    def __init__(self):
        self.state = None

    def on_fit_start(self, trainer, pl_module):
        self.state = snapshot(trainer, pl_module)


class TinyLM(L.LightningModule):
    """Tiny Llama (dropout on) that logs in training_step, updates a metric and a counter, and records its inputs."""

    def __init__(self, vocab_size: int = VOCAB, lr: float = 1e-2):
        super().__init__()
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            attention_dropout=0.2,
        )
        config._attn_implementation = "eager"
        self.model = LlamaForCausalLM(config)
        self.dropout = torch.nn.Dropout(0.2)
        self.train_loss = MeanMetric()
        self.lr = lr
        self.seen: list[dict] = []  # shape, keys, max id and RNG state after every training_step call
        self.real_tokens_seen = 0

    def training_step(self, batch, batch_idx):
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "labels") if k in batch}
        embeds = self.dropout(self.model.get_input_embeddings()(inputs.pop("input_ids")))
        loss = self.model(inputs_embeds=embeds, **inputs, use_cache=False).loss
        self.real_tokens_seen += batch["input_ids"].numel()
        self.train_loss.update(loss.detach())
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        self.log_dict({"train/mean_loss": self.train_loss}, batch_size=batch["input_ids"].shape[0])
        self.seen.append(
            {
                "shape": tuple(batch["input_ids"].shape),
                "keys": tuple(batch),
                "max_id": int(batch["input_ids"].max()),
                "rng": torch.get_rng_state().clone(),
            }
        )
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.model(**batch, use_cache=False).loss
        self.log("val/loss", loss, batch_size=batch["input_ids"].shape[0])
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)}


class TinyData(L.LightningDataModule):
    """Random documents of varying length, padded per batch (the `pad` batch contract)."""

    def __init__(self, rows: int = 2, max_length: int = 48, eval_rows: int | None = None, n: int = 16):
        super().__init__()
        self.micro_batch_size = rows
        self.eval_batch_size = eval_rows or rows
        self.max_length = max_length
        self.strategy = "pad"
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(4, max_length // 2, (n,), generator=g).tolist()
        self.docs = [torch.randint(1, VOCAB, (n_,), generator=g) for n_ in lengths]

    def _collate(self, docs):
        length = max(len(d) for d in docs)
        ids = torch.zeros(len(docs), length, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, d in enumerate(docs):
            ids[i, : len(d)] = d
            mask[i, : len(d)] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    def train_dataloader(self):
        return DataLoader(
            self.docs,
            batch_size=self.micro_batch_size,
            shuffle=True,
            collate_fn=self._collate,
            generator=torch.Generator().manual_seed(1),
        )

    def val_dataloader(self):
        return DataLoader(self.docs[:4], batch_size=self.eval_batch_size, collate_fn=self._collate)

    def batch_keys(self):
        return ("input_ids", "attention_mask", "labels")

    def max_batch_shape(self):
        return max(self.micro_batch_size, self.eval_batch_size), self.max_length


def trainer(tmp_path, callbacks, max_steps: int = 2, **kwargs) -> L.Trainer:
    kwargs = {"limit_val_batches": 0, "logger": False, **kwargs}
    return L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=callbacks,
        **kwargs,
    )
