"""FSDP under ``bf16-mixed`` keeps a RoPE model's rotary buffers in fp32 (issue 45 item 2).

Lightning's FSDP mixed precision for ``"bf16-mixed"`` sets ``buffer_dtype=torch.bfloat16``, so FSDP stores Llama's
``inv_freq`` in bf16 (rotary phases off by up to radians at long positions); DDP under the same precision keeps it in
fp32. Two forked gloo ranks under ``CPUFSDPStrategy`` (Lightning's ``FSDPStrategy``, its mixed precision untouched),
a strategy without ``mixed_precision`` (``CausalLM`` keeps the buffers in fp32) and one given a config that casts
buffers (a warning naming ``buffer_dtype``; the user's config is not changed).
"""

import warnings

import lightning.pytorch as L
import pytest
import torch
from _forked_ranks import run_ranks
from _memory_cpu_fsdp import CPUFSDPStrategy
from test_oom_split import TINY, VOCAB, padded
from torch.distributed.fsdp import MixedPrecision
from torch.utils.data import DataLoader
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from lightning_seqmem import CausalLM


def _fit_rank(rank: int, own_config: bool) -> tuple[torch.dtype, torch.Tensor, list[str]]:
    torch.manual_seed(0)
    model = CausalLM(model_config=TINY, vocab_size=VOCAB, pad_token_id=0)
    expected = model.model.model.rotary_emb.inv_freq.clone()
    mixed = MixedPrecision(torch.bfloat16, torch.bfloat16, torch.bfloat16) if own_config else None
    strategy = CPUFSDPStrategy(
        auto_wrap_policy={LlamaDecoderLayer}, process_group_backend="gloo", mixed_precision=mixed
    )
    trainer = L.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        precision="bf16-mixed",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader([padded(rows=2, seed=rank)], batch_size=None))
    inv_freq = model.model.model.rotary_emb.inv_freq
    drift = (inv_freq.float() - expected).abs().max()
    return inv_freq.dtype, drift, [str(w.message) for w in caught if "buffer_dtype" in str(w.message)]


@pytest.mark.slow
@pytest.mark.parametrize("own_config", [False, True])
def test_rotary_buffers_stay_fp32_under_fsdp_bf16_mixed(own_config):
    (dtype0, drift0, warned0), (dtype1, drift1, warned1) = run_ranks(_fit_rank, own_config, timeout=120)
    if own_config:  # the user's config is theirs: kept, and named once (rank 0)
        assert dtype0 == dtype1 == torch.bfloat16
        assert len(warned0) == 1 and "casts buffers to torch.bfloat16 (buffer_dtype)" in warned0[0] and not warned1
    else:
        assert dtype0 == dtype1 == torch.float32 and drift0 == drift1 == 0.0 and not warned0 + warned1
