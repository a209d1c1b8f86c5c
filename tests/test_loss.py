"""Token-weighted loss: an accumulated (and data-parallel) step follows the gradient of the mean over every label
token of the step, whatever each micro-batch holds; ``loss_normalization="micro_batch"`` keeps the old weighting."""

import copy
import json
import os
import traceback

import lightning.pytorch as L
import pytest
import torch
from _forked_ranks import run_ranks
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_seqmem import CausalLM
from lightning_seqmem.batching.collate import IGNORE_INDEX
from lightning_seqmem.training.loss import TokenLossNormalizer, power_of_two_scale, predicted_tokens, rescale_factor

VOCAB, LENGTH = 64, 24
TINY = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def micro_batch(predicted: int, rows: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """``[rows, LENGTH]`` padded-style batch whose labels predict exactly ``predicted`` tokens (completion-only)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (rows, LENGTH), generator=g)
    keep = torch.zeros(rows * (LENGTH - 1), dtype=torch.bool)
    keep[torch.randperm(keep.numel(), generator=g)[:predicted]] = True
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, 1:] = torch.where(keep.view(rows, LENGTH - 1), ids[:, 1:], IGNORE_INDEX)
    assert int(predicted_tokens(labels)) == predicted
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


class GradCapture(CausalLM):
    """Records, at every optimizer step, the parameters and the gradients the optimizer is about to use."""

    def __init__(self, *args, out_dir: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps, self.out_dir = [], out_dir

    def on_before_optimizer_step(self, optimizer):
        super().on_before_optimizer_step(optimizer)
        params = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}
        self.steps.append((params, grads))
        if self.out_dir is not None and self.global_rank == 0:
            torch.save(self.steps, os.path.join(self.out_dir, "steps.pt"))


class RankData(GradCapture):
    """Each rank reads its own micro-batches (rank r: ``PER_RANK[r]`` predicted tokens each)."""

    PER_RANK = ((46, 30), (4, 1))

    def train_dataloader(self):
        return DataLoader(
            [micro_batch(n, seed=10 * self.global_rank + i) for i, n in enumerate(self.PER_RANK[self.global_rank])],
            batch_size=None,
        )


def _reference_grads(params, batches):
    """Gradient of the mean loss over every label token of ``batches``, in one big batch, from ``params``."""
    model = CausalLM(model_config=TINY, vocab_size=VOCAB, pad_token_id=0).model
    model.load_state_dict(params)
    big = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    model(**big, use_cache=False).loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def relative_error(grads, reference):
    diff = torch.cat([(grads[n] - reference[n]).flatten() for n in reference])
    return (diff.norm() / torch.cat([g.flatten() for g in reference.values()]).norm()).item()


def _fit(model, batches, accumulate, tmp_path, **trainer_kwargs):
    L.seed_everything(0)
    kwargs = dict(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=accumulate,
        default_root_dir=tmp_path,
    )
    trainer = L.Trainer(**{**kwargs, **trainer_kwargs})
    trainer.fit(model, DataLoader(batches, batch_size=None))
    return trainer


def _model(cls=GradCapture, **kwargs):
    torch.manual_seed(0)
    return cls(model_config=TINY, vocab_size=VOCAB, pad_token_id=0, **kwargs)


# ------------------------------------------------------------------------------------------------ pure parts
def test_pure_parts():
    labels = torch.tensor([[5, 6, IGNORE_INDEX, 7], [IGNORE_INDEX, IGNORE_INDEX, 8, 9]])
    assert int(predicted_tokens(labels)) == 4  # the first position is never predicted
    assert [power_of_two_scale(n) for n in (0, 1, 46, 64, 100)] == [1.0, 1.0, 32.0, 64.0, 64.0]
    assert float(rescale_factor(32.0, 2, 2, torch.tensor(50))) == pytest.approx(32 * 2 * 2 / 50)
    assert float(rescale_factor(32.0, 2, 2, torch.tensor(0))) == 0.0  # a step without label tokens: no NaN


def test_normalizer_without_lightning():
    """The helper alone: micro-batch losses from num_items_in_batch, then one rescale = the big-batch gradient."""
    a, b = micro_batch(46), micro_batch(4, seed=1)
    model = _model().model
    params = copy.deepcopy(model.state_dict())
    norm = TokenLossNormalizer()
    for batch in (a, b):
        loss = model(**batch, num_items_in_batch=norm.add(batch["labels"]), use_cache=False).loss
        norm.add_loss(loss)
        loss.backward()
    step_loss = norm.rescale_gradients_(model.parameters(), accumulate_grad_batches=1, world_size=1)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert relative_error(grads, _reference_grads(params, [a, b])) <= 1e-5
    reference = CausalLM(model_config=TINY, vocab_size=VOCAB).model
    reference.load_state_dict(params)
    big = {k: torch.cat([a[k], b[k]]) for k in a}
    assert step_loss.item() == pytest.approx(reference(**big).loss.item(), rel=1e-5)
    assert norm.tokens is None  # a new step starts clean


class UserLM(L.LightningModule):
    """A user's own module following TokenLossNormalizer's docstring example (no ``on_train_start`` reset)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = CausalLM(model_config=TINY, vocab_size=VOCAB).model
        self.token_loss = TokenLossNormalizer()
        self.steps = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch, num_items_in_batch=self.token_loss.add(batch["labels"])).loss
        self.token_loss.add_loss(loss)
        return loss

    def on_before_optimizer_step(self, optimizer):
        loss = self.token_loss.rescale_gradients(self)
        if loss is not None:
            self.log("train/loss", loss)
        self.steps.append(
            (
                {n: p.detach().clone() for n, p in self.model.named_parameters()},
                {n: p.grad.detach().clone() for n, p in self.model.named_parameters()},
            )
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


# --------------------------------------------------------------------------------------- through the Trainer
def test_the_documented_recipe_in_a_users_own_module(tmp_path):
    batches = [micro_batch(46), micro_batch(4, seed=1)]
    model = UserLM()
    _fit(model, batches, 2, tmp_path)
    ((params, grads),) = model.steps
    assert relative_error(grads, _reference_grads(params, batches)) <= 1e-5


def test_accumulated_gradient_equals_the_big_batch_gradient(tmp_path):
    """46 and 4 predicted tokens in two micro-batches: the step's gradient is the 50-token mean's."""
    batches = [micro_batch(46), micro_batch(4, seed=1)]
    token = _model()
    trainer = _fit(token, batches, 2, tmp_path)
    ((params, grads),) = token.steps
    reference = _reference_grads(params, batches)
    assert relative_error(grads, reference) <= 1e-5
    # The logged loss is the step's true per-token loss.
    model = CausalLM(model_config=TINY, vocab_size=VOCAB).model
    model.load_state_dict(params)
    big = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    assert trainer.callback_metrics["train/loss"].item() == pytest.approx(model(**big).loss.item(), rel=1e-5)

    old = _model(loss_normalization="micro_batch")  # control: each micro-batch's mean counts equally
    _fit(old, batches, 2, tmp_path)
    assert relative_error(old.steps[0][1], reference) > 0.5


def test_last_partial_window_and_a_step_without_label_tokens(tmp_path):
    """3 micro-batches, accumulate 2: the epoch's last step holds one; a window with no label token steps with
    zero gradients and logs no NaN."""
    batches = [micro_batch(30), micro_batch(2, seed=1), micro_batch(17, seed=2)]
    model = _model()
    _fit(model, batches, 2, tmp_path)
    assert len(model.steps) == 2
    for (params, grads), window in zip(model.steps, (batches[:2], batches[2:])):
        assert relative_error(grads, _reference_grads(params, window)) <= 1e-5

    empty = _model()
    trainer = _fit(empty, [micro_batch(0), micro_batch(0, seed=1)], 2, tmp_path)
    ((_, grads),) = empty.steps
    assert all(torch.count_nonzero(g) == 0 for g in grads.values())
    assert all(torch.isfinite(p).all() for p in empty.parameters())
    assert "train/loss" not in trainer.callback_metrics or torch.isfinite(trainer.callback_metrics["train/loss"])


@pytest.mark.parametrize("module", [_model, UserLM], ids=["CausalLM", "users_own_module_without_reset"])
def test_a_preallocation_pass_does_not_count_in_the_first_step(tmp_path, module):
    """CachePreallocator runs training_step + backward on a dummy batch in on_fit_start: its tokens must not join
    the first optimizer step's count, in CausalLM and in a user's module that never calls reset()."""
    from lightning_seqmem.memory import CachePreallocator

    batches = [micro_batch(46), micro_batch(4, seed=1)]
    model = module()
    _fit(model, batches, 2, tmp_path, callbacks=[CachePreallocator(rows=2, length=LENGTH)])
    ((params, grads),) = model.steps
    assert relative_error(grads, _reference_grads(params, batches)) <= 1e-5


class GradNormMonitor(Callback):
    """A gradient-norm monitor as users write them: reads the gradients in its own on_before_optimizer_step."""

    def __init__(self):
        self.steps = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        params = {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}
        norm = torch.cat([p.grad.flatten() for p in pl_module.model.parameters()]).norm().item()
        self.steps.append((params, norm))


def test_a_callback_reads_the_per_token_mean_gradients_in_on_before_optimizer_step(tmp_path):
    """Callbacks' on_before_optimizer_step runs before the module's: the gradients are final there already (the
    rescale happens in the module's on_after_backward of the step's last micro-batch), in every window."""
    batches = [
        micro_batch(46),
        micro_batch(4, seed=1),
        micro_batch(10, seed=2),
        micro_batch(3, seed=3),
        micro_batch(20, seed=4),
    ]
    monitor = GradNormMonitor()
    _fit(_model(), batches, 2, tmp_path, callbacks=[monitor])
    assert len(monitor.steps) == 3
    for (params, norm), window in zip(monitor.steps, (batches[:2], batches[2:4], batches[4:])):
        reference = _reference_grads(params, window)
        assert norm == pytest.approx(torch.cat([g.flatten() for g in reference.values()]).norm().item(), rel=1e-5)


class _HostReads:
    """Records every tensor-to-host read (``item``, ``int(t)``, ``bool(t)``, ...) made while ``on`` is set, with the
    code that made it. On CUDA each is a sync that stalls the device while the host catches up."""

    NAMES = ("item", "__int__", "__float__", "__bool__", "tolist", "__index__")

    def __init__(self, monkeypatch):
        self.on, self.reads = False, []
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))

    def _wrap(self, name, original):
        def read(tensor, *args, **kwargs):
            if self.on:
                self.on = False
                self.reads.append((name, "".join(traceback.format_stack(limit=6)[:-1])))
                self.on = True
            return original(tensor, *args, **kwargs)

        return read


def test_the_training_step_reads_nothing_back_from_the_device(tmp_path, monkeypatch):
    """From batch start to batch end (training_step, backward hooks, the token rescale, logging, clipping, the
    optimizer), nothing outside the Hugging Face model's forward reads a tensor back to the host. (AdamW's step
    counters are host tensors even on CUDA: torch.optim is left out.)"""
    reads = _HostReads(monkeypatch)

    class Window(Callback):
        def on_train_batch_start(self, *args):
            reads.on = True

        def on_train_batch_end(self, *args):
            reads.on = False

    model = _model()
    forward = model.model.forward

    def unguarded_forward(*args, **kwargs):
        was, reads.on = reads.on, False
        try:
            return forward(*args, **kwargs)
        finally:
            reads.on = was

    monkeypatch.setattr(model.model, "forward", unguarded_forward)
    batches = [micro_batch(46), micro_batch(4, seed=1), micro_batch(10, seed=2)]
    trainer = _fit(model, batches, 2, tmp_path, callbacks=[Window()], gradient_clip_val=1.0)
    assert trainer.global_step == 2
    assert [(name, where) for name, where in reads.reads if "torch/optim/" not in where] == []


def test_gradient_clipping_sees_the_rescaled_gradients(tmp_path):
    batches = [micro_batch(46), micro_batch(4, seed=1)]
    unclipped = _model()
    _fit(unclipped, batches, 2, tmp_path)
    norm = torch.cat([g.flatten() for g in unclipped.steps[0][1].values()]).norm().item()

    class ClipRecorder(GradCapture):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            self.clipped = torch.cat([p.grad.flatten() for p in self.model.parameters()]).norm().item()

    clipped = _model(ClipRecorder)
    _fit(clipped, batches, 2, tmp_path, gradient_clip_val=norm / 2)
    assert clipped.clipped == pytest.approx(norm / 2, rel=1e-4)  # clipped from the true norm, not the scaled one


def test_fp16_grad_scaler_is_unscaled_before_the_rescale(tmp_path):
    """With a GradScaler (scale 4096) the step's gradients match the same fp16 run without one."""
    from lightning.pytorch.plugins import MixedPrecision

    batches = [micro_batch(46), micro_batch(4, seed=1)]
    steps = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=2.0**12)):
        model = _model()
        _fit(model, batches, 2, tmp_path, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
        steps.append(model.steps[0][1])
    assert relative_error(steps[1], steps[0]) <= 1e-5


def test_resume_is_bit_exact(tmp_path):
    """Three epochs of two accumulated steps each, uninterrupted or resumed from the end of the first."""
    batches = [micro_batch(n, seed=i) for i, n in enumerate((40, 3, 12, 25))]
    full = _model()
    _fit(
        full,
        batches,
        2,
        tmp_path,
        max_epochs=3,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, filename="{epoch}")],
    )
    L.seed_everything(0)
    resumed = _model()
    trainer = L.Trainer(
        max_epochs=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=2,
        default_root_dir=tmp_path,
    )
    trainer.fit(resumed, DataLoader(batches, batch_size=None), ckpt_path=str(tmp_path / "ckpt" / "epoch=0.ckpt"))
    assert trainer.global_step == 6 and len(resumed.steps) == 4
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


# ------------------------------------------------------------------------------------------------- two ranks
def _ddp_trainer(tmp_path, **kwargs) -> L.Trainer:
    """Lightning's DDP on one of two forked ranks (``_forked_ranks``), one epoch of each rank's own loader."""
    return L.Trainer(
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=tmp_path,
        **kwargs,
    )


def _fit_on_rank(rank, model, tmp_path):
    """One step of two accumulated micro-batches."""
    trainer = _ddp_trainer(tmp_path, accumulate_grad_batches=2)
    trainer.fit(model)
    assert trainer.global_rank == rank and trainer.global_step == 1


@pytest.mark.slow
@pytest.mark.parametrize("cross_entropy", ["full", "chunked"])
def test_two_gloo_ranks_with_different_token_counts(tmp_path, cross_entropy):
    """Rank 0 holds 46 + 30 label tokens, rank 1 holds 4 + 1: DDP's averaged gradient, rescaled, is the gradient
    of the mean over all 81 tokens — with the whole logits, and with the chunked loss layer (against the same
    full-logits reference)."""
    model = _model(RankData, out_dir=str(tmp_path), cross_entropy=cross_entropy, loss_chunk_size=7)
    run_ranks(_fit_on_rank, model, tmp_path)
    ((params, grads),) = torch.load(tmp_path / "steps.pt")
    batches = [
        micro_batch(n, seed=10 * r + i) for r, counts in enumerate(RankData.PER_RANK) for i, n in enumerate(counts)
    ]
    assert relative_error(grads, _reference_grads(params, batches)) <= 1e-5


class RankRows(CausalLM):
    """Rank r reads three micro-batches of ``1 + 3 r`` full rows: the ranks see different numbers of tokens."""

    def train_dataloader(self):
        rows = 1 + 3 * self.global_rank
        return DataLoader([micro_batch(4, rows=rows, seed=i) for i in range(3)], batch_size=None)


def _count_on_rank(rank, model, tmp_path):
    _ddp_trainer(tmp_path).fit(model)
    return model.real_tokens_seen


@pytest.mark.slow
def test_each_rank_counts_its_own_real_tokens_under_ddp(tmp_path):
    """The real-token counter is this rank's (RunSummary sums the ranks' counters): it was a module buffer, and
    DDP broadcasts rank 0's buffers before every forward, so rank 1 reported rank 0's tokens plus its last batch."""
    model = _model(RankRows)
    seen = run_ranks(_count_on_rank, model, tmp_path)
    assert seen == [3 * (1 + 3 * rank) * LENGTH for rank in (0, 1)]


class RankTest(CausalLM):
    """Rank r tests on two micro-batches of ``1 + 3 r`` rows, ``4 + 20 r`` label tokens each."""

    def test_dataloader(self):
        n, rows = 4 + 20 * self.global_rank, 1 + 3 * self.global_rank
        return DataLoader([micro_batch(n, rows=rows, seed=7 + i) for i in range(2)], batch_size=None)


def _test_on_rank(rank, model, tmp_path):
    return float(_ddp_trainer(tmp_path).test(model, verbose=False)[0]["test/loss"])


@pytest.mark.slow
def test_test_loss_is_the_per_token_loss_over_every_ranks_tokens(tmp_path):
    """``trainer.test`` under DDP: ``test/loss`` is the same on both ranks, the per-token loss over all four
    batches (as ``val/loss``); it was each rank's own mean."""
    model = _model(RankTest)
    losses = run_ranks(_test_on_rank, model, tmp_path)
    batches = [micro_batch(4 + 20 * r, rows=1 + 3 * r, seed=7 + i) for r in (0, 1) for i in range(2)]
    with torch.no_grad():
        pairs = [(model.loss(b).item(), int((b["labels"][:, 1:] != -100).sum())) for b in batches]
    expected = sum(loss * n for loss, n in pairs) / sum(n for _, n in pairs)
    assert losses == pytest.approx([expected, expected], rel=1e-5)


def test_bad_loss_normalization():
    with pytest.raises(ValueError, match="loss_normalization must be one of"):
        CausalLM(loss_normalization="mean")


if __name__ == "__main__":  # the before/after figure for the README: python tests/test_loss.py
    import tempfile

    batches = [micro_batch(46), micro_batch(4, seed=1)]
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("micro_batch", "token"):
            m = _model(loss_normalization=mode)
            _fit(m, batches, 2, tmp)
            params, grads = m.steps[0]
            print(
                json.dumps(
                    {
                        "loss_normalization": mode,
                        "relative_l2_error": relative_error(grads, _reference_grads(params, batches)),
                    }
                )
            )
