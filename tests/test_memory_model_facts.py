"""model_facts: the one place the memory callbacks read a user's LightningModule, on CausalLM and on a plain module."""

import lightning.pytorch as L
import torch

from lightning_seqmem import CausalLM
from lightning_seqmem.memory.estimate import module_facts
from lightning_seqmem.memory.model_facts import ModelFacts, model_facts

TINY = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def test_causal_lm_answers_every_fact_from_its_hugging_face_model():
    module = CausalLM(model_config=TINY, vocab_size=96, attn_implementation="eager", gradient_checkpointing=True)
    facts = model_facts(module)
    assert facts.config is module.model.config
    assert (facts.vocab_size, facts.attn_implementation, facts.gradient_checkpointing, facts.compiled) == (
        96,
        "eager",
        True,
        False,
    )
    assert module_facts(module) == {
        "model_config": module.model.config,
        "attn_implementation": "eager",
        "gradient_checkpointing": True,
        "cross_entropy": "full",  # "auto" decided: a 96-token vocabulary
        "chunk_size": module.hparams.loss_chunk_size,
        "lora": None,  # no adapter: the whole model trains
    }  # what the estimate traces
    chunked = CausalLM(model_config=TINY, vocab_size=96, cross_entropy="chunked", loss_chunk_size=64)
    assert (model_facts(chunked).cross_entropy, module_facts(chunked)["chunk_size"]) == ("chunked", 64)
    assert model_facts(CausalLM(model_config=TINY, vocab_size=96, compile=True)).compiled


def test_causal_lm_before_its_model_exists_answers_from_its_hyperparameters():
    facts = model_facts(CausalLM(model_config=TINY, attn_implementation="eager"))
    assert facts == ModelFacts(attn_implementation="eager", cross_entropy="auto")  # decided once the model exists
    assert module_facts(CausalLM(model_config=TINY)) is None


class Plain(L.LightningModule):
    """No ``.model``: facts come from its hyperparameters and attributes, or stay unknown."""

    def __init__(self, vocab_size: int | None = None, attn_implementation: str | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(4, 4)


def test_a_plain_lightning_module_without_model_has_no_config_to_trace():
    assert model_facts(Plain()) == ModelFacts()
    assert module_facts(Plain(vocab_size=50)) is None
    facts = model_facts(Plain(vocab_size=50, attn_implementation="sdpa"))
    assert (facts.config, facts.vocab_size, facts.attn_implementation) == (None, 50, "sdpa")
    module = Plain()
    module.vocab_size = 7  # an attribute counts when hparams do not say
    module.layer.compile()  # a compiled submodule (nothing is compiled until called)
    assert (model_facts(module).vocab_size, model_facts(module).compiled) == (7, True)
