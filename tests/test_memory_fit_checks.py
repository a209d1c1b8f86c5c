"""CachePreallocator and ConfigChecks warn, before allocating anything, when the traced estimate exceeds free memory."""

import lightning.pytorch as L
import pytest
import torch
from _memory_helpers import TinyData, TinyLM, trainer

from lightning_seqmem import CausalLM, SeqMemDataModule
from lightning_seqmem.memory import checks, preallocate
from lightning_seqmem.memory.checks import ConfigChecks
from lightning_seqmem.memory.estimate import cached_estimate, module_facts
from lightning_seqmem.memory.preallocate import CachePreallocator
from lightning_seqmem.training.building import MODEL_PRESETS


def _peak(module, rows, length, keys):
    facts = module_facts(module)
    return cached_estimate(
        facts["model_config"],
        rows,
        length,
        keys,
        "32-true",
        "cuda",
        facts["attn_implementation"],
        facts["gradient_checkpointing"],
    ).peak


@pytest.mark.slow
def test_preallocator_warns_with_the_micro_batch_size_that_fits_before_its_pass(tmp_path, monkeypatch):
    keys = ("input_ids", "attention_mask", "labels")
    model = TinyLM()
    free = (_peak(model, 2, 48, keys) + _peak(model, 4, 48, keys)) // 2  # 2 rows fit, 4 and 8 do not
    events = []
    monkeypatch.setattr(preallocate, "_is_cuda", lambda device: True)
    monkeypatch.setattr(preallocate, "_cuda_reset_peak", lambda device: None)
    monkeypatch.setattr(preallocate, "_cuda_allocated", lambda device: 0)
    monkeypatch.setattr(preallocate, "_cuda_peak_allocated", lambda device: 0)
    monkeypatch.setattr(preallocate, "_cuda_reserved", lambda device: 0)
    monkeypatch.setattr(preallocate, "_cuda_mem_get_info", lambda device: (free, 4 * free))
    monkeypatch.setattr(preallocate, "rank_zero_warn", lambda message: events.append(message))
    step = CachePreallocator._step
    monkeypatch.setattr(CachePreallocator, "_step", staticmethod(lambda *a: (events.append("pass"), step(*a))))
    L.seed_everything(0)
    trainer(tmp_path, [CachePreallocator(rows=8, length=48)], max_steps=1).fit(model, datamodule=TinyData())
    assert "micro_batch_size=2 fits" in events[0] and "8 x 48" in events[0]
    assert events[1] == "pass"  # said before anything was allocated for the worst case


def test_preallocator_is_quiet_when_the_estimate_fits(tmp_path, monkeypatch):
    events = []
    monkeypatch.setattr(preallocate, "_is_cuda", lambda device: True)
    for name in ("_cuda_reset_peak", "_cuda_allocated", "_cuda_peak_allocated", "_cuda_reserved"):
        monkeypatch.setattr(preallocate, name, lambda device: 0)
    monkeypatch.setattr(preallocate, "_cuda_mem_get_info", lambda device: (2**40, 2**40))
    monkeypatch.setattr(preallocate, "rank_zero_warn", lambda message: events.append(message))
    trainer(tmp_path, [CachePreallocator(rows=8, length=48)], max_steps=1).fit(TinyLM(), datamodule=TinyData())
    assert events == []


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*never reach the model.*")
def test_config_checks_use_the_same_estimate(tmp_path, monkeypatch, small_text_dataset):
    dm = SeqMemDataModule(small_text_dataset, max_length=64, micro_batch_size=8)
    # tiny_llama with one decoder layer: which micro_batch_size fits does not depend on depth, and each layer adds
    # thousands of traced ops to each of the four estimates this test makes
    one_layer = {**MODEL_PRESETS["tiny_llama"], "num_hidden_layers": 1}
    model = CausalLM(model_config=one_layer, vocab_size=len(dm.tokenizer), pad_token_id=dm.pad_token_id)
    rows, length = dm.max_batch_shape()
    free = (_peak(model, 4, length, dm.batch_keys()) + _peak(model, 8, length, dm.batch_keys())) // 2
    monkeypatch.setattr(checks, "_cuda_free_memory", lambda device: free)
    callback = ConfigChecks(skip=["eval_batch_size"])
    with pytest.warns(UserWarning, match="micro_batch_size=4 fits"):
        trainer(tmp_path, [callback], max_steps=1).fit(model, datamodule=dm)
    assert rows == 8 and "micro_batch_size=4 fits" in callback.problems["memory"]
    skipped = ConfigChecks(skip=["memory"])
    trainer(tmp_path, [skipped], max_steps=1).fit(model, datamodule=dm)
    assert "memory" not in skipped.problems


class _OOMAbove(TinyLM):
    """Runs out of memory (simulated) above 2 rows, like a GPU with `free` bytes would."""

    def training_step(self, batch, batch_idx):
        if batch["input_ids"].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.")
        return super().training_step(batch, batch_idx)


@pytest.mark.slow
def test_oom_in_the_pass_names_the_shape_and_the_micro_batch_size_that_fits(tmp_path, monkeypatch):
    keys = ("input_ids", "attention_mask", "labels")
    model = _OOMAbove()
    free = (_peak(model, 2, 48, keys) + _peak(model, 4, 48, keys)) // 2
    monkeypatch.setattr(preallocate, "_is_cuda", lambda device: True)
    for name in ("_cuda_reset_peak", "_cuda_allocated", "_cuda_peak_allocated", "_cuda_reserved"):
        monkeypatch.setattr(preallocate, name, lambda device: 0)
    monkeypatch.setattr(preallocate, "_cuda_mem_get_info", lambda device: (free, 4 * free))
    monkeypatch.setattr(preallocate, "rank_zero_warn", lambda message: None)
    with pytest.raises(preallocate.PreallocationOOMError) as info:
        trainer(tmp_path, [CachePreallocator(rows=8, length=48)], max_steps=1).fit(model, datamodule=TinyData())
    message = str(info.value)
    assert "rows=8, length=48" in message and "micro_batch_size=2 fits" in message
