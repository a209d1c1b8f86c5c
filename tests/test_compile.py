"""``CausalLM(compile=True)`` stays exact on packed batches.

Packing through ``position_ids`` alone has given silently wrong logits under ``torch.compile`` in transformers (a
packed-sequence check that cannot run while tracing). Here the compiled model gets a packed batch of several
documents per row, and every document's logits must be those it gets alone, from the same model uncompiled.

The model is compiled through ``compile={"backend": "aot_eager"}``: Dynamo traces it and AOTAutograd builds the graph
exactly as for inductor, which is where a packed-sequence check would be lost; inductor only generates code for that
graph, and doing so for this one layer costs 20-30 s of CPU on an empty cache (about a tenth of the whole suite's
wall time) for nothing this test checks. The options reach ``torch.compile`` (a counting backend below).
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from lightning_seqmem import CausalLM
from lightning_seqmem.training.varlen import cu_seqlens

TINY = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,  # one attention layer is where a packed document would see another; more only compile longer
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _documents(position_ids):
    """``(row, start, length)`` of every packed document."""
    length = position_ids.shape[1]
    cu = cu_seqlens(position_ids).tolist()
    return [(a // length, a % length, b - a) for a, b in zip(cu[:-1], cu[1:])]


def _worst_error(lm, ids, position_ids, logits):
    worst = 0.0
    with torch.no_grad():
        for row, start, n in _documents(position_ids):
            alone = lm.model.forward(input_ids=ids[row, start : start + n][None], use_cache=False).logits[0]
            worst = max(worst, (logits[row, start : start + n] - alone).abs().max().item())
    return worst


@pytest.mark.slow
def test_compiled_model_keeps_packed_documents_apart():
    torch.manual_seed(0)
    lm = CausalLM(model_config=TINY, vocab_size=100, pad_token_id=0, compile={"backend": "aot_eager"}).eval()
    assert lm.model._compiled_call_impl is not None  # compiled in place: same parameter names, same checkpoints
    assert not any("_orig_mod" in name for name in lm.state_dict())
    position_ids = torch.tensor(
        [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5]]
    )
    ids = torch.randint(1, 100, position_ids.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        compiled = lm({"input_ids": ids, "position_ids": position_ids}).logits  # through the compiled __call__
        leaky = lm.model.forward(input_ids=ids, use_cache=False).logits  # eager, rows as single sequences
    assert len(_documents(position_ids)) == 5
    assert _worst_error(lm, ids, position_ids, compiled) <= 1e-5
    assert _worst_error(lm, ids, position_ids, leaky) > 1e-3  # control: the check sees a leak when there is one


def test_compile_options_reach_torch_compile():
    """``compile`` as ``torch.compile``'s arguments: the backend given is the one that compiles the forward."""
    torch._dynamo.reset()
    counter = CompileCounter()
    lm = CausalLM(model_config=TINY, vocab_size=100, pad_token_id=0, compile={"backend": counter, "dynamic": False})
    with torch.no_grad():
        lm({"input_ids": torch.ones(1, 8, dtype=torch.long)})
    assert counter.frame_count >= 1
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "compile, named",
    [({"mode": "max-autotune", "modee": 1}, "'modee'"), ("yes", "compile='yes'"), (1, "compile=1")],
)
def test_bad_compile_options_are_refused_by_name(compile, named):
    with pytest.raises(ValueError) as info:
        CausalLM(model_config=TINY, vocab_size=100, pad_token_id=0, compile=compile)
    assert named in str(info.value) and "mode" in str(info.value)


def test_compile_options_from_hydra_are_plain_arguments():
    """``model.compile='{mode: max-autotune}'`` on seqmem-train's command line reaches the model as a DictConfig."""
    from omegaconf import OmegaConf

    from lightning_seqmem.training.building import compile_options

    given = OmegaConf.create({"mode": "max-autotune", "dynamic": False})
    assert compile_options(given) == {"mode": "max-autotune", "dynamic": False}
    assert compile_options(True) == {} and compile_options(False) is None and compile_options({}) == {}
