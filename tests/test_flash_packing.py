"""Flash attention keeps packed documents apart at micro-batch > 1.

transformers' real flash dispatch (``_flash_attention_forward``) with the CUDA kernels replaced by exact SDPA
reference kernels (``_flash_reference``): every document of a packed ``[4, seq]`` batch gets the logits it gets
alone, for FA2, FA3 and a hub kernel; without the varlen arguments the same batch leaks across documents.
(GPT-2's flash path cannot run in fp32 without autocast in transformers 5.x: it looks for an ``nn.Linear`` to pick
a dtype and GPT-2 has ``Conv1D`` layers; Llama and Qwen2 are the two architectures tested.)"""

import lightning.pytorch as L
import pytest
import torch
from _flash_reference import use_reference_flash

from lightning_seqmem import CausalLM, SeqMemDataModule
from lightning_seqmem.collate import PackCollator
from lightning_seqmem.memory.checks import ConfigChecks
from lightning_seqmem.varlen import cu_seqlens, flash_varlen_kwargs, is_flash_attention, segment_starts
from lightning_seqmem.warmup.transform import set_batch_sequence_length

TINY = {
    "llama": dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
    "qwen2": dict(model_type="qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
}


@pytest.fixture()
def reference_flash(monkeypatch):
    use_reference_flash(monkeypatch)


def _texts():
    import datasets

    return datasets.Dataset.from_dict({"text": [f"note {i}: " + "the quick brown fox " * (1 + i % 5)
                                                for i in range(48)]})


@pytest.fixture()
def packed_batch():
    dm = SeqMemDataModule(dataset=_texts(), strategy="pack", max_length=64, micro_batch_size=4)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (4, 64) and "attention_mask" not in batch
    assert int(segment_starts(batch["position_ids"]).sum()) > 4 + 2  # rows really hold several documents
    return dm, batch


def _segments(position_ids):
    """``(row, start, length)`` of every segment."""
    cu = cu_seqlens(position_ids).tolist()
    length = position_ids.shape[1]
    return [(a // length, a % length, b - a) for a, b in zip(cu[:-1], cu[1:])]


def _max_error_against_alone(lm, batch, packed_logits):
    worst = 0.0
    with torch.no_grad():
        for row, start, n in _segments(batch["position_ids"]):
            ids = batch["input_ids"][row, start : start + n]
            alone = lm.model(input_ids=ids[None], use_cache=False).logits[0]
            worst = max(worst, (packed_logits[row, start : start + n] - alone).abs().max().item())
    return worst


# ---------------------------------------------------------------------------------------------- pure functions
def test_cu_seqlens_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]])
    assert cu_seqlens(pos).tolist() == [0, 3, 5, 7, 10]
    assert cu_seqlens(pos).dtype == torch.int32
    kwargs = flash_varlen_kwargs(pos)
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 3 and isinstance(kwargs["max_length_q"], int)
    assert kwargs["cu_seq_lens_q"] is kwargs["cu_seq_lens_k"]
    # A row that starts mid-document (positions not at 0) is still its own segment: rows never attend to each other.
    assert cu_seqlens(torch.tensor([[0, 1, 2], [3, 4, 0]])).tolist() == [0, 3, 5, 6]
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        cu_seqlens(torch.arange(4))


def test_cu_seqlens_agree_with_the_collator_and_after_warmup_reshape(tokenizer):
    rows = [{"input_ids": list(range(1, 10)), "seq_lengths": [4, 5]},
            {"input_ids": list(range(1, 7)), "seq_lengths": [2, 3, 1]}]
    batch = PackCollator(pad_token_id=0, max_length=12, return_cu_seqlens=True)(rows)
    assert torch.equal(cu_seqlens(batch["position_ids"]), batch["cu_seqlens"])
    set_batch_sequence_length(batch, 4, truncate=False)  # reshape: more, shorter rows; cu_seqlens recomputed by warmup
    assert torch.equal(cu_seqlens(batch["position_ids"]), batch["cu_seqlens"])


def test_is_flash_attention():
    for name in ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn2"):
        assert is_flash_attention(name)
    for name in ("sdpa", "eager", "flex_attention", None):
        assert not is_flash_attention(name)


# ------------------------------------------------------------------------------- flash through transformers
@pytest.mark.parametrize("arch,attn", [
    ("llama", "flash_attention_2"), ("llama", "flash_attention_3"), ("llama", "kernels-community/flash-attn2"),
    ("qwen2", "flash_attention_2"),
])
def test_packed_documents_get_their_logits_alone_at_micro_batch_4(reference_flash, packed_batch, arch, attn):
    dm, batch = packed_batch
    torch.manual_seed(0)
    lm = CausalLM(model_config=TINY[arch], vocab_size=len(dm.tokenizer), pad_token_id=dm.pad_token_id,
                  attn_implementation=attn).eval()
    assert lm.model.config._attn_implementation == attn
    with torch.no_grad():
        fixed = lm(batch).logits
        leaky = lm.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    assert _max_error_against_alone(lm, batch, fixed) <= 1e-5
    # Negative control: transformers' own position_ids inference (batch of one row only) leaves them mixed.
    assert _max_error_against_alone(lm, batch, leaky) > 1e-3


def test_sdpa_gets_no_varlen_arguments_and_stays_clean(packed_batch, monkeypatch):
    dm, batch = packed_batch
    torch.manual_seed(0)
    lm = CausalLM(model_config=TINY["llama"], vocab_size=len(dm.tokenizer), attn_implementation="sdpa").eval()
    seen = []
    forward = lm.model.forward
    monkeypatch.setattr(lm.model, "forward", lambda **kw: seen.append(sorted(kw)) or forward(**kw))
    with torch.no_grad():
        logits = lm(batch).logits
    assert "cu_seq_lens_q" not in seen[0]
    assert _max_error_against_alone(lm, batch, logits) <= 1e-5


def test_trainer_fit_with_flash_and_packing_warns_nothing(reference_flash, tmp_path):
    dm = SeqMemDataModule(dataset=_texts(), strategy="pack", max_length=64, micro_batch_size=4)
    checks = ConfigChecks()
    lm = CausalLM(model_config=TINY["llama"], attn_implementation="flash_attention_2")
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1,
                        val_check_interval=2, callbacks=[checks], default_root_dir=tmp_path)
    trainer.fit(lm, datamodule=dm)
    assert not {"packing_attention", "flash_varlen"} & set(checks.problems)
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
