"""``CausalLM`` and ``DPO`` with ``cross_entropy="chunked"`` give the full path's losses and gradients.

A tiny Llama built from a config (no download), fp32 on CPU, with a small ``loss_chunk_size`` so every batch spans
several chunks. Each comparison is checked to catch a real difference too (labels shifted by one more token).
"""

import lightning.pytorch as L
import pytest
import torch

from lightning_seqmem import DPO, CachePreallocator, CausalLM
from lightning_seqmem.batch import COMPLETION_MASK, SEQUENCE_INDEX
from lightning_seqmem.memory.worst_batch import make_dummy_batch
from lightning_seqmem.training.loss import TokenLossNormalizer
from lightning_seqmem.training.loss_layer import AUTO_CHUNKED_LOGITS, resolve_cross_entropy

VOCAB = 211
TOL = 1e-5
TINY = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=True,
)


def _pair(model_cls=CausalLM, config=TINY, **kwargs):
    """The same weights twice: one with the full loss layer, one chunked (7 tokens per chunk)."""
    torch.manual_seed(0)
    full = model_cls(model_config=config, vocab_size=VOCAB, pad_token_id=0, cross_entropy="full", **kwargs)
    chunked = model_cls(
        model_config=config, vocab_size=VOCAB, pad_token_id=0, cross_entropy="chunked", loss_chunk_size=7, **kwargs
    )
    chunked.load_state_dict(full.state_dict())
    return full, chunked


def _padded(rows=3, length=20, seed=0):
    ids = torch.randint(1, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :6] = -100  # a prompt without loss
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _packed(seed=0):
    layout = ((5, 9, 4), (12, 3))  # several documents per row, padding at the end of the second
    return make_dummy_batch(2, 20, ("input_ids", "labels", "position_ids"), VOCAB, seed=seed, layout=layout)


def _loss_and_grads(model, batch, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = model.loss(batch, **kwargs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _worst_difference(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert grads_a.keys() == grads_b.keys()
    return max([abs(loss_a - loss_b).item()] + [(grads_a[n] - grads_b[n]).abs().max().item() for n in grads_a])


@pytest.mark.parametrize("make_batch", [_padded, _packed], ids=["padded", "packed"])
@pytest.mark.parametrize("num_items", [None, 16.0], ids=["mean", "token-weighted"])
def test_chunked_loss_and_gradients_match_the_full_path(make_batch, num_items):
    full, chunked = _pair()
    assert full.model.get_output_embeddings().weight is full.model.get_input_embeddings().weight  # tied
    batch = make_batch()
    kwargs = {} if num_items is None else {"num_items_in_batch": num_items}
    reference = _loss_and_grads(full, batch, **kwargs)
    assert "model.model.embed_tokens.weight" in reference[1]  # the tied embedding gets both gradients
    assert _worst_difference(reference, _loss_and_grads(chunked, batch, **kwargs)) <= TOL
    # Negative control: labels shifted by one more token must be caught by the same comparison.
    shifted = dict(batch, labels=torch.roll(batch["labels"], 1, dims=1))
    assert _worst_difference(reference, _loss_and_grads(chunked, shifted, **kwargs)) > 100 * TOL


def test_untied_head_gets_its_own_gradient():
    full, chunked = _pair(config=dict(TINY, tie_word_embeddings=False))
    reference = _loss_and_grads(full, _padded())
    assert "model.lm_head.weight" in reference[1]
    assert _worst_difference(reference, _loss_and_grads(chunked, _padded())) <= TOL


def test_token_weighted_loss_over_two_micro_batches_matches():
    """Two micro-batches with very different label counts, summed and rescaled as one optimizer step."""
    batches = [_padded(seed=1), _packed(seed=2)]
    results = []
    for model in _pair():
        normalizer = TokenLossNormalizer()
        model.zero_grad(set_to_none=True)
        for batch in batches:
            loss = model.loss(batch, num_items_in_batch=normalizer.add(batch["labels"]))
            normalizer.add_loss(loss)
            loss.backward()
        step_loss = normalizer.rescale_gradients_(model.parameters(), 1, 1)
        results.append((step_loss, {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert _worst_difference(*results) <= TOL
    # and it is the per-token mean over both micro-batches
    tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    full = results[0][0].item()
    summed = sum(_pair()[0].loss(b, num_items_in_batch=1.0).item() for b in batches)
    assert abs(full - summed / tokens) <= TOL


def _padded_pairs(pairs=2, length=16):
    keys = ("input_ids", "attention_mask", COMPLETION_MASK, "labels")
    layout = tuple((length - 3 * (i % 2),) for i in range(2 * pairs))  # rejected rows shorter: padding
    batch = make_dummy_batch(2 * pairs, length, keys, VOCAB, layout=layout)
    batch[COMPLETION_MASK][:, :5] = 0  # the prompt
    return batch


def _packed_pairs():
    keys = ("input_ids", "labels", "position_ids", COMPLETION_MASK, SEQUENCE_INDEX)
    layout = ((6, 8, 5), (7, 4, 9))  # 6 sequences: 3 pairs (chosen 0..2, rejected 3..5)
    batch = make_dummy_batch(2, 24, keys, VOCAB, seed=3, layout=layout)
    batch[COMPLETION_MASK][:, ::4] = 0  # some prompt tokens in every sequence
    return batch


@pytest.mark.parametrize("make_batch", [_padded_pairs, _packed_pairs], ids=["padded", "packed"])
def test_dpo_chunked_matches_the_full_path(make_batch):
    full, chunked = _pair(DPO, beta=0.5)
    batch = make_batch()
    for model in (full, chunked):
        model.setup("fit")  # the frozen reference copy
        with torch.no_grad():  # the policy moved away from the reference, so the loss has a gradient
            for p in model.model.parameters():
                p.mul_(1.01)
    results = []
    for model in (full, chunked):
        model.zero_grad(set_to_none=True)
        loss, _ = model.pair_loss(batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads))
        reference = torch.stack(model.reference_logps(batch))
        results[-1][1]["reference"] = reference
    assert results[0][1]["reference"].abs().min() > 1  # real sums of completion log-probabilities
    assert _worst_difference(*results) <= TOL
    # Negative control: the completion mask shifted by one token
    shifted = dict(batch, **{COMPLETION_MASK: torch.roll(batch[COMPLETION_MASK], 1, dims=1)})
    wrong = torch.stack(chunked.sequence_logps(chunked.model, shifted)).detach()
    assert (wrong - torch.stack(full.sequence_logps(full.model, batch)).detach()).abs().max() > 100 * TOL


def test_bad_options_name_themselves():
    with pytest.raises(ValueError, match="cross_entropy='fast'"):
        CausalLM(cross_entropy="fast")
    with pytest.raises(ValueError, match="loss_chunk_size=0"):
        CausalLM(cross_entropy="chunked", loss_chunk_size=0)
    with pytest.raises(ValueError, match="loss_chunk_size"):
        CausalLM(loss_chunk_size=2.5)
    with pytest.raises(ValueError, match="cross_entropy='liger'"):
        DPO(cross_entropy="liger")
    lm = CausalLM(model_config=TINY, vocab_size=VOCAB, cross_entropy="liger")
    with pytest.raises((ImportError, ValueError), match="liger"):  # not installed here, and no CUDA either
        lm.setup("fit")


def test_a_head_the_kernel_cannot_apply_is_refused_by_name():
    lm = CausalLM(model_config=dict(TINY, dim_model_base=16), vocab_size=VOCAB, cross_entropy="chunked")
    with pytest.raises(ValueError, match=r"LlamaConfig.dim_model_base=16 .*cross_entropy='full'"):
        lm.setup("fit")


HEADS = {  # heads that do more than a matmul, applied per chunk from their config fields
    "gemma2": dict(model_type="gemma2", head_dim=8, final_logit_softcapping=3.0),  # cap * tanh(logits / cap)
    "cohere": dict(model_type="cohere", logit_scale=0.25, bos_token_id=1, eos_token_id=2),  # logits * scale
    "granite": dict(model_type="granite", logits_scaling=4.0),  # logits / scaling
}


@pytest.mark.parametrize("head", sorted(HEADS))
def test_soft_capped_and_scaled_heads_are_applied_per_chunk(head):
    config = dict({k: v for k, v in TINY.items() if k != "model_type"}, **HEADS[head])
    full, chunked = _pair(config=config, attn_implementation="eager")
    batch = _padded()
    assert _worst_difference(_loss_and_grads(full, batch), _loss_and_grads(chunked, batch)) <= TOL


def test_auto_is_chunked_where_the_logits_matter():
    assert resolve_cross_entropy("auto", 4096, 8 * 1024) == "full"  # the built-in tokenizer's vocabulary
    assert resolve_cross_entropy("auto", 151_936, 4096) == "chunked"  # Qwen 2.5 at 4,096 tokens
    assert resolve_cross_entropy("auto", 128_256, None) == "chunked"  # no shape known: 4,096 tokens
    assert resolve_cross_entropy("auto", 2**13, 2**13) == "chunked" and 2**26 == AUTO_CHUNKED_LOGITS
    assert resolve_cross_entropy("full", 151_936, 4096) == "full"
    assert CausalLM(model_config=TINY, vocab_size=VOCAB).loss_layer == "full"


def test_trainer_fit_with_the_chunked_loss(small_text_dataset, tmp_path):
    from lightning_seqmem import SeqMemDataModule

    dm = SeqMemDataModule(dataset=small_text_dataset, max_length=64, micro_batch_size=4, strategy="pack")
    model = CausalLM(model_config=TINY, cross_entropy="chunked", loss_chunk_size=64)
    preallocator = CachePreallocator()
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=1,
        val_check_interval=2,
        accumulate_grad_batches=2,
        default_root_dir=tmp_path,
        callbacks=[preallocator],  # its worst-case pass runs the module's own training_step: the chunked loss
    )
    trainer.fit(model, datamodule=dm)
    assert model.loss_layer == "chunked" and trainer.global_step == 2
    assert preallocator.report.passes == ["fit_start"]
    metrics = trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss"]) and torch.isfinite(metrics["val/loss"])
