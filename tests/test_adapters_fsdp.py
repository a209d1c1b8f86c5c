"""LoRA under FSDP keeps what it keeps on one device or under DDP: a checkpoint without the frozen base that resumes
the adapter and its optimizer state exactly, and ``SaveAdapter``'s adapter in PEFT's format, written once.

Two forked CPU ranks over gloo stand in for two GPUs (``_memory_cpu_fsdp.CPUFSDPStrategy``, each decoder layer its
own FSDP unit, as a real run wraps them); DDP on the same rows is the reference. Each mode trains two of three steps
(one epoch), saves a checkpoint, and a second run resumes it for the third step.
"""

from functools import partial

import pytest
import torch
from _adapters_fsdp_script import LORA, main
from _forked_ranks import run_ranks

peft = pytest.importorskip("peft")

from lightning_seqmem.training.adapter_checkpoints import BASE_RECORD  # noqa: E402

# One DDP and one FSDP run (the ``runs`` fixture) answer the module's tests: on one worker, made once.
pytestmark = pytest.mark.xdist_group("adapters_fsdp")

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Llama saved as a pretrained base (random weights; tied head and embedding: two keys, one parameter)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=64, pad_token_id=0, **TINY)
    path = str(tmp_path_factory.mktemp("base"))
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory):
    """``{mode: (first run, resumed run, checkpoint)}`` for "ddp" and "fsdp", and the base's directory."""
    root = tmp_path_factory.mktemp("adapters_fsdp")
    done = {"base": base}
    for mode in ("ddp", "fsdp"):
        ckpt = str(root / mode / "stopped.ckpt")
        first = run_ranks(main, mode, base, str(root / mode), 2, ckpt)
        resumed = run_ranks(main, mode, base, str(root / mode / "resumed"), None, None, ckpt)
        done[mode] = first, resumed, torch.load(ckpt, weights_only=False)
    return done


def test_a_pretrained_base_admits_a_state_without_its_whole_base_and_nothing_less(base):
    """What lets Lightning's FSDP load a checkpoint that left the base out (it loads before on_load_checkpoint):
    a strict load of the adapter alone keeps the base; a state that lacks part of the base, or of the adapter,
    still fails; a random base (no pretrained_path) admits nothing."""
    from lightning_seqmem import CausalLM

    model = CausalLM(pretrained_path=base, lora=LORA)
    state = model.state_dict()
    adapter = {name for name, p in model.named_parameters() if p.requires_grad}
    before = {name: value.clone() for name, value in state.items()}
    changed = {name: value + 1 if name in adapter else value for name, value in state.items()}
    only_adapter = {name: value for name, value in changed.items() if not name.startswith("model.") or name in adapter}
    model.load_state_dict(only_adapter)
    after = model.state_dict()
    assert all(torch.equal(after[n], changed[n] if n in adapter else before[n]) for n in state)
    head = "model.base_model.model.lm_head.weight"  # tied: the embedding's weight under a second key
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict({n: v for n, v in state.items() if n != head})
    with pytest.raises(RuntimeError, match="lora_A"):
        model.load_state_dict({n: v for n, v in only_adapter.items() if n != min(adapter)})
    random = CausalLM(model_config=dict(model_type="llama", **TINY), vocab_size=64, lora=LORA)
    with pytest.raises(RuntimeError, match="Missing key"):
        random.load_state_dict({n: v for n, v in random.state_dict().items() if n in adapter or "model." not in n})


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
def test_a_sharded_fsdp_checkpoint_keeps_its_shards_whole_and_resumes_exactly(runs, tmp_path):
    """state_dict_type="sharded": each rank writes its shards and torch's distributed checkpoint loads by name
    every entry the model has, so nothing is left out (a checkpoint without the base could not be loaded)."""
    sharded = partial(main, sharded=True)
    first = run_ranks(sharded, "fsdp", runs["base"], str(tmp_path), 2, str(tmp_path / "stopped"))
    assert BASE_RECORD not in torch.load(tmp_path / "stopped" / "meta.pt", weights_only=False)
    resumed = run_ranks(sharded, "fsdp", runs["base"], str(tmp_path / "resumed"), None, None, str(tmp_path / "stopped"))
    _same(resumed[0]["steps"][2], first[0]["steps"][2])
    _same(resumed[0]["steps"][3], runs["fsdp"][1][0]["steps"][3])  # the full checkpoint's resumed step


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
