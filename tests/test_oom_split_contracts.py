"""``on_oom="split"``: the GPU contracts a CPU run can hold (issue 45), on one process.

- the parts' backward runs outside the precision plugin's autocast: a model region that runs in fp32 with autocast
  off (an LM head, a router) gets the gradient the unsplit step gives, with no out-of-memory error at all;
- "CUDA error: out of memory" raised as ``torch.AcceleratorError`` (cuBLAS, NCCL) is an out-of-memory error;
- the "row does not fit" error carries torch's own text and the memory read while the failed attempt was alive;
- a survived out-of-memory error is logged as one line at the time;
- DeepSpeed is refused at any world size, and under ``on_oom="raise"`` no Lightning hook looks overridden;
  reentrant checkpointing with a weight shared across checkpointed segments is refused;
- per-source validation losses (``CausalLM``, any ``on_oom``) keep their sums on the device: no host read per batch.
"""

import logging
import weakref
from types import SimpleNamespace

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from test_oom_split import _fit, _model, padded, worst_relative
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

from lightning_seqmem import CausalLM
from lightning_seqmem.batch import SOURCE_INDEX, count_label_tokens
from lightning_seqmem.oom import runner
from lightning_seqmem.oom.runner import OomSplitter, RowDoesNotFit, is_out_of_memory
from lightning_seqmem.oom.split import OomInjector


class Gradients(L.Callback):
    """The gradients the optimizer is about to step on."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads = {n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters()}


def fp32_head(model: CausalLM) -> CausalLM:
    """The LM head computed in fp32 with autocast off, as some transformers models run their heads and routers."""
    head, plain = model.model.lm_head, model.model.lm_head.forward

    def forward(hidden):
        with torch.autocast("cpu", enabled=False):
            return plain(hidden.float())

    head.forward = forward
    return model


def test_the_split_backward_runs_outside_autocast():
    """bf16-mixed, nothing runs out of memory: the split step's gradient is the unsplit one (6.7e-3 off when each
    part's backward ran inside Lightning's autocast: the fp32 head's backward matmuls in bf16)."""
    grads = {}
    for on_oom in ("raise", "split"):
        model = fp32_head(_model(on_oom=on_oom, cross_entropy="full"))
        callback = Gradients()
        L.seed_everything(0)
        trainer = L.Trainer(
            max_steps=1,
            accelerator="cpu",
            precision="bf16-mixed",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[callback],
        )
        trainer.fit(model, DataLoader([padded(rows=4)], batch_size=None))
        grads[on_oom] = callback.grads
    assert worst_relative(grads["split"], grads["raise"]) <= 1e-6


def test_accelerator_out_of_memory_is_out_of_memory():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(torch.AcceleratorError("CUDA error: out of memory"))
    assert not is_out_of_memory(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
    assert not is_out_of_memory(RuntimeError("out of memory"))  # not from the device


def test_a_cublas_out_of_memory_is_split_too():
    """An allocation outside the caching allocator fails as ``AcceleratorError``: split like any other."""
    linear = torch.nn.Linear(4, 1)
    rows = torch.randn(4, 4)

    def forward(part):
        if part["input_ids"].shape[0] > 2:
            raise torch.AcceleratorError("CUDA error: out of memory")
        return linear(rows[part["input_ids"][:, 0]]).sum(), {}

    batch = {"input_ids": torch.arange(4).unsqueeze(1)}
    outcome = OomSplitter().run(batch, forward, lambda loss: loss.backward(), linear.parameters())
    assert outcome.failed is None and outcome.loss == pytest.approx(linear(rows).sum().item(), rel=1e-6)


def test_the_failure_is_recorded_while_the_failed_attempt_is_alive(monkeypatch):
    """The memory figure is read inside the handler (the failed graph still held), and torch's text is kept."""
    alive = []

    def forward(part):
        activations = torch.ones(8)
        finalizer = weakref.finalize(activations, lambda: None)
        alive.append(finalizer)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected)")

    monkeypatch.setattr(runner, "memory_now", lambda device: (int(alive[-1].alive), 0))
    outcome = OomSplitter().run({"input_ids": torch.ones(1, 4, dtype=torch.long)}, forward)
    assert outcome.failed["allocated"] == 1  # read before the activations were released
    message = runner.does_not_fit_message(outcome.failed)
    assert "Torch said: CUDA out of memory. Tried to allocate 20.00 GiB (injected)." in message


def test_a_row_that_does_not_fit_says_what_torch_said():
    model = _model(on_oom="split")
    OomInjector(10).install(model.model)
    with pytest.raises(RowDoesNotFit, match=r"Torch said: injected: 24 tokens > 10 \(OomInjector\)\. Fixes"):
        _fit(model, [padded(rows=1)])


def test_a_survived_out_of_memory_is_logged_at_the_time(caplog):
    model = _model(on_oom="split")
    OomInjector(40).install(model.model)
    with caplog.at_level(logging.WARNING, logger="lightning_seqmem.oom"):
        _fit(model, [padded(rows=4, seed=s) for s in range(2)])
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("lightning_seqmem.oom")]
    assert lines == [
        "on_oom='split': train step 0: a micro-batch of 96 tokens ran out of memory (3 failed attempt(s)); it ran in "
        "parts, same gradient. Micro-batches of 48 tokens or more are split before they run from now on."
    ]  # one line, at the first step; the second micro-batch is split before it runs: nothing to log


def test_deepspeed_is_refused_at_any_world_size_and_raise_overrides_nothing():
    from lightning.pytorch.strategies import DeepSpeedStrategy

    deepspeed = object.__new__(DeepSpeedStrategy)  # the class check only: deepspeed need not be installed
    model = _model(on_oom="split")
    model._trainer = SimpleNamespace(world_size=1, strategy=deepspeed)
    with pytest.raises(ValueError, match=r"does not run under DeepSpeed \(at any world size\)"):
        model._check_oom_strategy()
    plain = _model(on_oom="raise")  # DeepSpeed warns about an overridden backward: nothing is, under "raise"
    assert not any(is_overridden(hook, plain) for hook in ("backward", "optimizer_step", "optimizer_zero_grad"))
    assert all(is_overridden(hook, model) for hook in ("backward", "optimizer_step", "optimizer_zero_grad"))


@pytest.mark.parametrize("reentrant", [True, False])
def test_reentrant_checkpointing_with_a_shared_weight_is_refused(reentrant):
    """Each reentrant segment accumulates into a shared weight on its own: a split would give it a wrong gradient."""
    model = _model(on_oom="split")
    layers = model.model.model.layers
    layers[1].mlp.up_proj.weight = layers[0].mlp.up_proj.weight
    model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model._trainer = SimpleNamespace(world_size=1, strategy=object())
    if reentrant:
        with pytest.raises(ValueError, match=r"mlp.up_proj.weight is shared with model.layers.0, another checkpoint"):
            model._check_oom_strategy()
    else:
        model._check_oom_strategy()  # non-reentrant: each parameter accumulated once, after every segment


class HostReads(TorchDispatchMode):
    """Counts the reads of a tensor's value by the host (``.item()``, ``int()``, ``bool()``: a device sync on CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_per_source_validation_losses_need_no_host_read_per_batch():
    model = _model()
    model._trainer = SimpleNamespace(datamodule=SimpleNamespace(source_names=lambda: ("long", "short")))
    losses = {0: [2.0, 4.0], 1: [1.0]}
    batches = []
    for source, values in losses.items():
        for value in values:
            batch = padded(rows=2, seed=len(batches))
            batch[SOURCE_INDEX] = torch.full((2,), source)
            batches.append((batch, torch.tensor(value)))
    with HostReads() as host:
        for i, (batch, loss) in enumerate(batches):
            model.on_validation_batch_end(loss, batch, i)
    assert host.reads == 0  # was one per batch (the source index read on the host)
    means, tokens = model._source_losses.compute()
    weights = [float(count_label_tokens(b)) for b, _ in batches]
    expected = (2.0 * weights[0] + 4.0 * weights[1]) / (weights[0] + weights[1])
    assert means.tolist() == pytest.approx([expected, 1.0]) and tokens.tolist() == [sum(weights[:2]), weights[2]]
