"""Lightning's FSDP full-state-dict checkpoint on CPU ranks (torch 2.13): without the library's in-place gathering
the save kills rank 0 with a segmentation fault (run in forked ranks, so the crash stays in a child); with it, the
checkpoint holds the whole model, the weights every rank gathers. Two forked gloo ranks stand in for two GPUs
(``_memory_cpu_fsdp.CPUFSDPStrategy``: Lightning's strategy, its state-dict code untouched)."""

import lightning.pytorch as L
import pytest
import torch
from _forked_ranks import run_ranks
from _fsdp_full_save_script import main

from lightning_seqmem.training.fsdp_cpu import gather_full_state_dict_in_place


@pytest.mark.slow  # two forked ranks train a step each
def test_the_full_checkpoint_saves_on_cpu_ranks_and_holds_the_gathered_weights(tmp_path):
    path = str(tmp_path / "full.ckpt")
    ranks = run_ranks(main, path, timeout=120)
    saved = torch.load(path, weights_only=False)["state_dict"]
    weights = ranks[0]["weights"]
    assert set(saved) == set(weights)  # the LightningModule's parameter names: every one, nothing else
    for name, value in weights.items():
        assert torch.equal(saved[name], value), name  # whole tensors, not shards
    assert all(torch.equal(ranks[1]["weights"][n], w) for n, w in weights.items())


@pytest.mark.slow
def test_without_the_in_place_gathering_lightnings_save_crashes_rank_0(tmp_path):
    with pytest.raises(AssertionError, match=r"rank 0 failed:\ndied \(exit code -11\)"):
        run_ranks(main, str(tmp_path / "full.ckpt"), False, timeout=120)


def test_only_fsdp_on_a_cpu_root_device_is_changed():
    assert not gather_full_state_dict_in_place(L.strategies.SingleDeviceStrategy("cpu"))
    assert not gather_full_state_dict_in_place(L.strategies.DDPStrategy())
    fsdp = L.strategies.FSDPStrategy(parallel_devices=[torch.device("cpu")])  # Trainer(accelerator="cpu")
    assert not gather_full_state_dict_in_place(L.strategies.FSDPStrategy(parallel_devices=[torch.device("cuda", 0)]))
    before = fsdp.lightning_module_state_dict
    assert gather_full_state_dict_in_place(fsdp) and gather_full_state_dict_in_place(fsdp)
    assert fsdp.lightning_module_state_dict.__wrapped__ == before  # wrapped once
