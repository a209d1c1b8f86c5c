"""LoRA under FSDP keeps what it keeps on one device or under DDP: a checkpoint without the frozen base that resumes
the adapter and its optimizer state exactly, and ``SaveAdapter``'s adapter in PEFT's format, written once.

Two forked CPU ranks over gloo stand in for two GPUs (``_memory_cpu_fsdp.CPUFSDPStrategy``, each decoder layer its
own FSDP unit, as a real run wraps them); DDP on the same rows is the reference. Each mode trains two of three steps
(one epoch), saves a checkpoint, and a second run resumes it for the third step.
"""

import pytest
import torch
from _adapters_fsdp_script import main
from _forked_ranks import run_ranks

peft = pytest.importorskip("peft")

from lightning_seqmem.training.adapter_checkpoints import BASE_RECORD  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{mode: (first run, resumed run, checkpoint)}`` for "ddp" and "fsdp", and the base's directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters_fsdp")
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=64,
        pad_token_id=0,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,  # the head is the embedding: two keys, one parameter
    )
    base = str(root / "base")
    AutoModelForCausalLM.from_config(config).save_pretrained(base)
    done = {"base": base}
    for mode in ("ddp", "fsdp"):
        ckpt = str(root / mode / "stopped.ckpt")
        first = run_ranks(main, mode, base, str(root / mode), 2, ckpt)
        resumed = run_ranks(main, mode, base, str(root / mode / "resumed"), None, None, ckpt)
        done[mode] = first, resumed, torch.load(ckpt, weights_only=False)
    return done


def _same(got, want):
    assert got.keys() == want.keys() and got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
def test_fsdp_checkpoint_leaves_the_base_out_and_resumes_the_adapter_and_optimizer_exactly(runs):
    (first, resumed, ckpt), (_, ddp_resumed, ddp_ckpt) = runs["fsdp"], runs["ddp"]
    adapter = set(first[0]["steps"][2])
    assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter)
    # the adapter and nothing of the base (FSDP's full state dict names it as DDP's does), the base's keys recorded
    assert {key for key in ckpt["state_dict"] if key.startswith("model.")} == adapter
    assert sorted(ckpt[BASE_RECORD]) == sorted(ddp_ckpt[BASE_RECORD]) and len(ckpt[BASE_RECORD]) > 10
    state = ckpt["optimizer_states"][0]["state"]
    assert len(state) == len(adapter) and all(v["exp_avg"].numel() <= 4 * 64 for v in state.values())
    # the resume rebuilt the base from pretrained_path and restored the adapter where the stopped run left it ...
    _same(resumed[0]["steps"][2], first[0]["steps"][2])
    # ... and its optimizer state: the third step is DDP's third step after its own resume
    _same(resumed[0]["steps"][3], ddp_resumed[0]["steps"][3])


@pytest.mark.slow
def test_save_adapter_under_fsdp_writes_the_ddp_adapter_once_in_peft_format(runs):
    from transformers import AutoModelForCausalLM

    (fsdp, _, _), (ddp, _, _) = runs["fsdp"], runs["ddp"]
    saved = fsdp[0]["saved_to"]
    assert saved is not None and saved.endswith("fsdp/adapter") and fsdp[1]["saved_to"] is None  # rank 0 wrote it
    base = AutoModelForCausalLM.from_pretrained(runs["base"], local_files_only=True)
    loaded = peft.PeftModel.from_pretrained(base, saved)
    weights = {f"model.{n}": p.detach() for n, p in loaded.named_parameters() if ".lora_" in n}
    _same(weights, ddp[0]["steps"][2])  # the adapter after step 2, as DDP (and one process) has it
    reference = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(runs["base"], local_files_only=True), ddp[0]["saved_to"]
    )
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, reference(input_ids=ids).logits)
