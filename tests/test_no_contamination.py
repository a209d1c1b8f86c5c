"""No contamination, numerically: a packed batch through real Hugging Face models gives the same per-document
losses as running each document alone. Tiny random-weight models, fp32, no download."""

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from lightning_seqmem.batching import pack_sequences
from lightning_seqmem.batching.collate import IGNORE_INDEX, PackCollator

VOCAB = 64


def _llama(attn: str):
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(cfg)


def _gpt2(attn: str):
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, attn_implementation=attn)
    return GPT2LMHeadModel(cfg)


def _docs():
    g = torch.Generator().manual_seed(0)
    lengths = [7, 3, 12, 5, 2, 9, 16, 4, 11]
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_packed_losses_equal_separate_losses(build, attn):
    torch.manual_seed(0)
    model = build(attn).eval()
    docs = _docs()
    packed = pack_sequences(docs, max_length=16)
    assert packed.num_rows < len(docs)  # rows really hold several documents
    batch = PackCollator(pad_token_id=0, max_length=16)([packed.row(r) for r in range(packed.num_rows)])
    with torch.no_grad():
        out = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"], use_cache=False
        )
        logits = out.logits
        alone = {
            i: model(input_ids=torch.tensor([d]), labels=torch.tensor([d]), use_cache=False).loss
            for i, d in enumerate(docs)
        }

    seg = 0
    total, count = 0.0, 0
    for r in range(packed.num_rows):
        start = 0
        for n in packed.row_lengths(r):
            doc = int(packed.segment_doc[seg])
            seg += 1
            ids = batch["input_ids"][r, start : start + n]
            assert ids.tolist() == docs[doc]
            loss = F.cross_entropy(logits[r, start : start + n - 1], ids[1:])
            assert abs(loss.item() - alone[doc].item()) <= 1e-5, (attn, doc)
            total += loss.item() * (n - 1)
            count += n - 1
            start += n
    # The model's own loss on the packed batch averages exactly the per-document losses (labels -100 at joins).
    assert (batch["labels"] != IGNORE_INDEX).sum().item() == count
    assert abs(out.loss.item() - total / count) <= 1e-5


def test_the_check_detects_contamination():
    """Control: without restarting position_ids the same packed batch leaks across documents."""
    torch.manual_seed(0)
    model = _llama("sdpa").eval()
    docs = _docs()
    packed = pack_sequences(docs, max_length=16)
    batch = PackCollator(pad_token_id=0, max_length=16)([packed.row(r) for r in range(packed.num_rows)])
    r = next(i for i in range(packed.num_rows) if len(packed.row_lengths(i)) > 1)
    first, second = packed.row_lengths(r)[:2]
    doc = docs[int(packed.segment_doc[packed.seg_row_offsets[r] + 1])]
    ids = batch["input_ids"][r : r + 1]
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([doc]), labels=torch.tensor([doc])).loss.item()
        leaky = model(input_ids=ids).logits[0, first : first + second - 1]
    assert abs(F.cross_entropy(leaky, ids[0, first + 1 : first + second]).item() - alone) > 1e-3
