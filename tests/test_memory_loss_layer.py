"""The memory estimate and the planner follow the loss layer (``cross_entropy``) and show its share of the peak.

A large-vocabulary tiny Llama (32,000 tokens, hidden 64, one decoder layer): its logits dominate the step, as a
real model's do at today's vocabularies. Estimates are traced on fake tensors; one is checked against a real CPU step.
"""

import pytest

from lightning_seqmem.apps.plan_memory import memory_table, plan_memory
from lightning_seqmem.memory.estimate import cached_estimate, shortfall_message
from lightning_seqmem.memory.measured import measured_training_peak
from lightning_seqmem.memory.worst_batch import make_dummy_batch
from lightning_seqmem.training.building import build_model_config

KEYS = ("input_ids", "attention_mask", "labels")
BIG_VOCAB = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def config():
    return build_model_config(BIG_VOCAB, 32_000, 0)


def _estimate(config, rows=2, length=256, **kwargs):
    """``estimate_training_memory``, remembered per shape and settings (``cached_estimate``, as the callbacks and
    ``shortfall_message`` remember them): the shapes several tests and the planner ask for are traced once."""
    return cached_estimate(config, rows, length, KEYS, device="cpu", chunk_size=128, **kwargs)


def test_chunked_estimate_is_smaller_and_its_loss_layer_a_fraction_of_the_full_one(config):
    full, chunked = _estimate(config, cross_entropy="full"), _estimate(config, cross_entropy="chunked")
    assert (full.cross_entropy, chunked.cross_entropy) == ("full", "chunked")
    logits = 2 * 256 * 32_000 * 4  # one fp32 copy of the logits
    assert full.loss_layer >= 2 * logits  # the logits, their softmax or gradient: at least two copies at the peak
    assert full.loss_layer <= full.activations
    assert chunked.peak < full.peak - logits
    assert chunked.loss_layer < logits / 2  # one chunk of 128 tokens and the fp32 weight-gradient accumulator
    # Parameters, gradients and optimizer state do not change with the loss layer.
    assert (chunked.state["parameters"], chunked.state["optimizer_state"]) == (
        full.state["parameters"],
        full.state["optimizer_state"],
    )


def test_auto_decides_on_the_traced_shape(config):
    assert _estimate(config, rows=1, length=128, cross_entropy="auto").cross_entropy == "full"  # 4 M logits
    assert _estimate(config, rows=2, length=2048, cross_entropy="auto").cross_entropy == "chunked"  # 131 M


def test_chunked_estimate_agrees_with_a_real_cpu_step(config):
    """The tracer keeps every position (fake tensors cannot count labels); the real step keeps the trained ones,
    here all but the padding of one row: the estimate may only be a little above."""
    layout = ((256,), (200,))
    batch = make_dummy_batch(2, 256, KEYS, 32_000, layout=layout)
    real = measured_training_peak(config, batch, cross_entropy="chunked", chunk_size=128)
    est = _estimate(config, cross_entropy="chunked")
    assert real * 0.97 <= est.peak <= real * 1.08, (est.peak, real)


@pytest.mark.slow
def test_planner_recommends_the_chunked_loss_when_it_makes_a_candidate_fit(config):
    def estimate(rows, length, checkpointing, cross_entropy="full"):
        return _estimate(config, rows, length, cross_entropy=cross_entropy, gradient_checkpointing=checkpointing)

    full_one = estimate(1, 256, False).peak
    chunked_two = estimate(2, 256, False, "chunked").peak
    assert chunked_two < full_one  # the budget below fits 2 chunked rows, not one full row
    memory = plan_memory(estimate, 256, [1, 2, 4], budget=int(chunked_two * 1.01), margin=0.0)
    assert memory.fits[False] is None and memory.chunked_fits == 2
    assert "cross_entropy='chunked' fits micro_batch_size=2" in memory.advice
    text = "\n".join(memory_table(memory))
    assert "of which loss layer" in text and "chunked" in text and "Loss layer:" in text
    # the share of the peak is printed per row
    line = next(line for line in text.splitlines() if line.split()[:3] == ["1", "no", "full"])
    assert "%)" in line


def test_shortfall_message_points_at_the_loss_layer(config):
    message = shortfall_message(config, (2, 256), KEYS, available=1, device="cpu")
    assert "cross_entropy='chunked'" in message
