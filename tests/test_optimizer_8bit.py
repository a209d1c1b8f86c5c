"""The 8-bit optimizer lever (issue 32.5): ``CausalLM(optimizer="adamw_8bit")`` trains with bitsandbytes'
AdamW8bit on CUDA and is refused elsewhere with the fix; the estimate counts its state as bitsandbytes keeps it
(memory/optimizer_8bit.py), and CachePreallocator's stand-ins reserve the same."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from _memory_helpers import VOCAB, TinyData

from lightning_seqmem import CausalLM
from lightning_seqmem.memory.estimate import estimate_training_memory
from lightning_seqmem.memory.optimizer_8bit import AdamW8bitShape, state_bytes
from lightning_seqmem.memory.optimizer_state import state_standins
from lightning_seqmem.training.building import build_model_config
from lightning_seqmem.training.optimization import check_optimizer


def bnb_state_bytes(numel: int) -> int:
    """bitsandbytes' Optimizer2State.init_state for AdamW8bit, written out: under min_8bit_size=4096 values two fp32
    moments; else two uint8 moments shaped like the parameter plus absmax1/absmax2, fp32 [ceil(n / 256)] each."""
    if numel < 4096:
        return 2 * 4 * numel
    return 2 * numel + 2 * 4 * ((numel // 256) + bool(numel % 256))


def test_adamw_8bit_is_refused_where_bitsandbytes_cannot_run_naming_the_option_and_the_fix():
    with pytest.raises(ValueError, match=r"optimizer='sgd' is not valid; use 'adamw'.*'adamw_8bit'"):
        CausalLM(vocab_size=VOCAB, optimizer="sgd")
    model = CausalLM(vocab_size=VOCAB, optimizer="adamw_8bit")
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, barebones=True)
    fix = r"needs a CUDA device.*not cpu: use optimizer='adamw' \(model.optimizer=adamw\), or train on a CUDA GPU"
    with pytest.raises(ValueError, match=fix):
        trainer.fit(model, datamodule=TinyData())  # refused at setup, before any step
    with pytest.raises((ValueError, ImportError), match="optimizer='adamw_8bit'"):
        check_optimizer("adamw_8bit", "cuda")  # no CUDA here: refused for want of bitsandbytes


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_adamw_8bit_asked_for_cuda_on_a_machine_without_it_is_refused_as_qlora_is():
    """The Trainer's device named 'cuda' is not enough: no CUDA device is visible (the one rule QLoRA follows too,
    ``checks.require_bitsandbytes``), whether or not bitsandbytes is installed."""
    with pytest.raises(ValueError, match=r"optimizer='adamw_8bit'.*needs a CUDA device.*not a machine without CUDA"):
        check_optimizer("adamw_8bit", "cuda")


@pytest.mark.parametrize("shape", [(64, 64), (4096, 1), (3000, 7), (100,)])  # at, above (ragged block), below 4,096
def test_the_8bit_state_is_what_bitsandbytes_keeps(shape):
    p = torch.nn.Parameter(torch.zeros(shape))
    p.grad = torch.ones(shape)
    optimizer = AdamW8bitShape([p])
    optimizer.step()
    state = optimizer.state[p]
    mine = [t for key, t in state.items() if isinstance(t, torch.Tensor) and not key.startswith("qmap")]
    assert sum(t.numel() * t.element_size() for t in mine) == state_bytes(p.numel()) == bnb_state_bytes(p.numel())
    assert state["state1"].dtype == (torch.uint8 if p.numel() >= 4096 else torch.float32)
    assert (p == -1e-3).all()  # updated in place
    # CachePreallocator's stand-ins for bitsandbytes' own optimizer (told by its module and args) are the same bytes
    bnb_like = type("AdamW8bit", (torch.optim.SGD,), {"__module__": "bitsandbytes.optim.adamw"})([p], lr=1.0)
    bnb_like.args = type("Args", (), {"optim_bits": 8, "min_8bit_size": 4096})()
    assert sum(t.numel() * t.element_size() for t in state_standins(bnb_like)) == bnb_state_bytes(p.numel())


def test_the_estimate_counts_the_8bit_state():
    fields = dict(model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=1)
    config = build_model_config({**fields, "num_attention_heads": 4, "num_key_value_heads": 2}, 512, 0)
    args = (config, 1, 16, ("input_ids", "labels"), "32-true", "cpu")
    eight = estimate_training_memory(*args, optimizer="adamw_8bit")
    full = estimate_training_memory(*args)
    from lightning_seqmem.memory.fake_model import build_model

    sizes = [p.numel() for p in build_model(config).parameters()]
    assert eight.state["optimizer_state"] == sum(map(bnb_state_bytes, sizes)) + 2 * 256 * 4  # + the shared maps
    assert full.state["optimizer_state"] >= 8 * sum(sizes) > 3 * eight.state["optimizer_state"]
    assert eight.state["parameters"] == full.state["parameters"] and eight.peak < full.peak
