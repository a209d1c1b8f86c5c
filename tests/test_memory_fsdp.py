"""FSDP trains with norm clipping and pre-allocation, and its token-weighted gradient is DDP's.

Two forked CPU ranks over gloo stand in for two GPUs (``_memory_cpu_fsdp.CPUFSDPStrategy``: only the wrapper's
``device_id`` differs from Lightning's ``FSDPStrategy``). The same run on a CUDA machine: ``benchmarks/gpu.py``.
"""

import math
from functools import partial

import pytest
import torch
from _forked_ranks import run_ranks
from _memory_fsdp_script import main
from _memory_helpers import TinyLM

from lightning_seqmem.memory.estimate import cached_estimate, sharded, shortfall_message


@pytest.fixture(scope="module")
def ddp():
    """The DDP reference run (full logits), shared by the tests that compare FSDP's gradient with it."""
    return run_ranks(main, "ddp")


def _same_gradient(fsdp, ddp):
    assert ddp.keys() == fsdp.keys() and len(ddp) > 10
    for name in ddp:
        torch.testing.assert_close(fsdp[name], ddp[name], rtol=1e-5, atol=1e-8, msg=name)


@pytest.mark.slow
def test_fsdp_clips_preallocates_and_gives_the_ddp_gradient(ddp):
    """gradient_clip_val=0.05 under FSDP (Lightning's FSDP precision refuses norm clipping: CausalLM clips through
    FSDP's clip_grad_norm_); CachePreallocator runs through the FSDP wrapper and leaves each rank's state
    bit-identical (checked in the script); ranks see different numbers of label tokens, and the clipped,
    token-weighted gradient equals DDP's."""
    fsdp = run_ranks(main, "fsdp")
    done = {(kind, rank): run[rank]["done"] for kind, run in (("ddp", ddp), ("fsdp", fsdp)) for rank in (0, 1)}
    assert set(done.values()) == {"1 [16, 5]"}, done  # one step; FSDP decays the 16 matrices DDP decays, not 5 norms
    _same_gradient(fsdp[0]["grads"], ddp[0]["grads"])
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in fsdp[0]["grads"].values()))
    assert norm == pytest.approx(0.05, rel=1e-4)  # it did clip


@pytest.mark.slow
def test_chunked_loss_under_fsdp_gives_the_full_logits_ddp_gradient(ddp):
    """``cross_entropy="chunked"`` under FSDP (the head's weight read where FSDP has gathered it, chunks of 7
    tokens) gives DDP's gradient with the whole logits: same clipped, token-weighted step."""
    chunked = run_ranks(partial(main, chunked=True), "fsdp")
    _same_gradient(chunked[0]["grads"], ddp[0]["grads"])


@pytest.mark.slow
def test_fsdp_worst_case_that_does_not_fit_fails_with_the_shape():
    text = run_ranks(partial(main, oom=True), "fsdp")[0]["oom"]
    assert text.startswith("PreallocationOOMError") and "rows=3, length=32" in text and "micro_batch_size" in text
    assert "shapes: [(3, 32)]" in text  # failed in the pass, before any real step


def test_sharded_estimate_counts_state_once_per_rank():
    config = TinyLM().model.config
    keys = ("input_ids", "attention_mask", "labels")
    whole = cached_estimate(config, 4, 48, keys, "32-true", "cuda", "eager")
    half = sharded(whole, 2)
    shared = whole.parameters + whole.gradients + whole.optimizer_state
    assert half.peak == whole.peak - shared + half.parameters + half.gradients + half.optimizer_state
    assert half.parameters == whole.parameters // 2 and half.activations == whole.activations
    fits = dict(shape=(4, 48), keys=keys, available=half.peak, attn_implementation="eager")
    assert shortfall_message(config, shards=2, **fits) is None
    assert "4 x 48" in shortfall_message(config, shards=1, **fits)
