"""Flash attention keeps packed documents apart at micro-batch > 1.

transformers' real flash dispatch (``_flash_attention_forward``) with the CUDA kernels replaced by exact SDPA
reference kernels (``_flash_reference``): every document of a packed ``[4, seq]`` batch gets the logits it gets
alone, for FA2, FA3 and a hub kernel; without the varlen arguments the same batch leaks across documents.
(GPT-2's flash path cannot run in fp32 without autocast in transformers 5.x: it looks for an ``nn.Linear`` to pick
a dtype and GPT-2 has ``Conv1D`` layers; Llama and Qwen2 are the two architectures tested.)

The same for ``torch_varlen`` (torch's own varlen kernel, ``lightning_seqmem.training.attention``): transformers' real
attention dispatch, ``torch.nn.attention.varlen.varlen_attn`` replaced by the exact reference under each keyword
form torch has had; packed documents and padded rows get their logits alone; ``"auto"`` and the errors."""

import functools

import lightning.pytorch as L
import pytest
import torch
from _flash_reference import CALLS, TORCH_VARLEN_FORMS, use_reference_flash, use_reference_torch_varlen

from lightning_seqmem import CausalLM, SeqMemDataModule
from lightning_seqmem.batching.collate import PackCollator
from lightning_seqmem.memory import CachePreallocator
from lightning_seqmem.memory.checks import ConfigChecks
from lightning_seqmem.training import attention
from lightning_seqmem.training.varlen import (
    batch_varlen_kwargs,
    cu_seqlens,
    flash_varlen_kwargs,
    is_flash_attention,
    segment_starts,
)
from lightning_seqmem.warmup.transform import set_batch_sequence_length

TINY = {
    "llama": dict(
        model_type="llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    ),
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    ),
}


@pytest.fixture()
def reference_flash(monkeypatch):
    use_reference_flash(monkeypatch)


def _texts():
    import datasets

    return datasets.Dataset.from_dict(
        {"text": [f"note {i}: " + "the quick brown fox " * (1 + i % 5) for i in range(48)]}
    )


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


def _bf16_mixed():
    """Where ``"auto"`` picks ``torch_varlen``: bf16-mixed (the kernel takes fp16/bf16 only), here on the CPU."""
    return torch.autocast("cpu", dtype=torch.bfloat16)


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
    rows = [
        {"input_ids": list(range(1, 10)), "seq_lengths": [4, 5]},
        {"input_ids": list(range(1, 7)), "seq_lengths": [2, 3, 1]},
    ]
    batch = PackCollator(pad_token_id=0, max_length=12, return_cu_seqlens=True)(rows)
    assert torch.equal(cu_seqlens(batch["position_ids"]), batch["cu_seqlens"])
    set_batch_sequence_length(batch, 4, truncate=False)  # reshape: more, shorter rows; cu_seqlens recomputed by warmup
    assert torch.equal(cu_seqlens(batch["position_ids"]), batch["cu_seqlens"])


def test_is_flash_attention():
    for name in ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn2", "torch_varlen"):
        assert is_flash_attention(name)
    for name in ("sdpa", "eager", "flex_attention", None):
        assert not is_flash_attention(name)


# ------------------------------------------------------------------------------- flash through transformers
@pytest.mark.parametrize(
    "arch,attn",
    [
        ("llama", "flash_attention_2"),
        ("llama", "flash_attention_3"),
        ("llama", "kernels-community/flash-attn2"),
        ("qwen2", "flash_attention_2"),
    ],
)
def test_packed_documents_get_their_logits_alone_at_micro_batch_4(reference_flash, packed_batch, arch, attn):
    dm, batch = packed_batch
    torch.manual_seed(0)
    lm = CausalLM(
        model_config=TINY[arch], vocab_size=len(dm.tokenizer), pad_token_id=dm.pad_token_id, attn_implementation=attn
    ).eval()
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
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        val_check_interval=2,
        callbacks=[checks],
        default_root_dir=tmp_path,
    )
    trainer.fit(lm, datamodule=dm)
    assert not {"packing_attention", "flash_varlen"} & set(checks.problems)
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


# ------------------------------------------------------------------------------- torch's own varlen kernel
def test_batch_varlen_kwargs_split_documents_and_runs_of_padding():
    ids = torch.ones(3, 4, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1], [1, 1, 1, 1]])  # right padding, left padding, none
    kwargs = batch_varlen_kwargs({"input_ids": ids, "attention_mask": mask})
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 3, 4, 6, 8, 12] and kwargs["max_length_q"] == 4
    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]])
    packed = batch_varlen_kwargs({"input_ids": torch.ones_like(pos), "position_ids": pos})
    assert all(torch.equal(torch.as_tensor(packed[k]), torch.as_tensor(v)) for k, v in flash_varlen_kwargs(pos).items())


def test_the_installed_torch_kernel_has_a_form_the_adapter_knows():
    """The stand-in's forms cover the real signature here (torch 2.13): causal through window_size or is_causal."""
    kernel = attention.varlen_kernel()
    if kernel is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    keywords = attention._keywords(kernel)
    assert "window_size" in keywords or "is_causal" in keywords
    assert keywords <= set(attention._keywords(TORCH_VARLEN_FORMS["2.12"])) | {"is_causal"}


@pytest.mark.parametrize("arch,form", [("llama", "2.10"), ("llama", "2.11"), ("llama", "2.12"), ("qwen2", "2.12")])
def test_torch_varlen_packed_documents_get_their_logits_alone(monkeypatch, packed_batch, arch, form):
    use_reference_torch_varlen(monkeypatch, form)
    dm, batch = packed_batch
    torch.manual_seed(0)
    lm = CausalLM(
        model_config=TINY[arch],
        vocab_size=len(dm.tokenizer),
        pad_token_id=dm.pad_token_id,
        attn_implementation="torch_varlen",
    ).eval()
    assert lm.model.config._attn_implementation == "torch_varlen"
    rows, length = batch["input_ids"].shape
    with torch.no_grad(), _bf16_mixed():
        fixed = lm(batch).logits
        segments = CALLS[-1][1]
        # Without cu_seq_lens the segments come from position_ids (a model called directly): exact as well.
        direct = lm.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        # Negative control: one segment per row (right positions, no document boundaries) leaks.
        rows_only = torch.arange(0, (rows + 1) * length, length, dtype=torch.int32)
        leaky = lm.model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            use_cache=False,
            cu_seq_lens_q=rows_only,
            cu_seq_lens_k=rows_only,
            max_length_q=length,
            max_length_k=length,
        ).logits
    assert {form} == {f for f, _ in CALLS} and segments == len(_segments(batch["position_ids"]))
    with _bf16_mixed():
        assert _max_error_against_alone(lm, batch, fixed) <= 1e-5
        assert _max_error_against_alone(lm, batch, direct) <= 1e-5
        assert _max_error_against_alone(lm, batch, leaky) > 1e-3


def test_torch_varlen_padded_rows_get_their_logits_alone(monkeypatch):
    """Left and right padding: every real token's logits are those of its row without the padding."""
    use_reference_torch_varlen(monkeypatch)
    torch.manual_seed(0)
    lm = CausalLM(model_config=TINY["llama"], vocab_size=64, pad_token_id=0, attn_implementation="torch_varlen").eval()
    ids = torch.randint(4, 64, (3, 12))
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0
    mask[1, :5] = 0
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad(), _bf16_mixed():
        logits = lm({"input_ids": ids, "attention_mask": mask}).logits
        assert CALLS[-1][1] == 5  # three runs of real tokens and two of padding
        for row in range(3):
            real = mask[row].bool()
            # Positions count from the row start, as under SDPA: the row alone with the same positions.
            positions = torch.nonzero(real).squeeze(1)[None]
            alone = lm.model(input_ids=ids[row, real][None], position_ids=positions, use_cache=False).logits[0]
            assert (logits[row, real] - alone).abs().max().item() <= 1e-5


def test_auto_and_explicit_torch_varlen_where_it_cannot_run(monkeypatch):
    assert attention.resolve_attn_implementation("auto", "cpu", "bf16-mixed") == "sdpa"
    assert attention.resolve_attn_implementation("sdpa", "cuda") == "sdpa"
    with pytest.raises(ValueError, match=r"runs on CUDA only.*attn_implementation='auto'"):
        attention.resolve_attn_implementation("torch_varlen", "cpu")
    monkeypatch.setattr(attention, "_device_reason", lambda device: None)  # a CUDA device that could run it
    assert attention.resolve_attn_implementation("auto", "cuda", "bf16-mixed") == "torch_varlen"
    assert attention.resolve_attn_implementation("auto", "cuda", "32-true") == "sdpa"
    with pytest.raises(ValueError, match=r"fp16/bf16 only, and precision='32-true'"):
        attention.resolve_attn_implementation("torch_varlen", "cuda", "32-true")
    monkeypatch.setattr(attention, "varlen_kernel", lambda: None)
    assert attention.resolve_attn_implementation("auto", "cuda", "bf16-mixed") == "sdpa"
    with pytest.raises(ValueError, match=r"has no torch.nn.attention.varlen.varlen_attn.*torch 2.10"):
        attention.resolve_attn_implementation("torch_varlen", "cuda", "bf16-mixed")


def _fit(tmp_path, attn, extra_callbacks=(), **trainer_kwargs):
    dm = SeqMemDataModule(dataset=_texts(), strategy="pack", max_length=64, micro_batch_size=4)
    checks = ConfigChecks()
    lm = CausalLM(model_config=TINY["llama"], attn_implementation=attn)
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        val_check_interval=2,
        callbacks=[checks, *extra_callbacks],
        default_root_dir=tmp_path,
        **trainer_kwargs,
    )
    trainer.fit(lm, datamodule=dm)
    return lm, trainer, checks


def test_trainer_fit_auto_picks_torch_varlen_where_it_runs_and_sdpa_elsewhere(monkeypatch, tmp_path):
    lm, trainer, _ = _fit(tmp_path, "auto")  # CPU: SDPA
    assert lm.model.config._attn_implementation == "sdpa" and trainer.global_step == 2
    use_reference_torch_varlen(monkeypatch)  # a device where the kernel runs
    prealloc = CachePreallocator()  # its pass runs the kernel under the same autocast, before the first step
    lm, trainer, checks = _fit(tmp_path, "auto", [prealloc], precision="bf16-mixed")
    assert prealloc.report.passes == ["fit_start"]
    assert lm.model.config._attn_implementation == "torch_varlen" and lm.hparams.attn_implementation == "auto"
    assert len(CALLS) >= 2 * 2 * TINY["llama"]["num_hidden_layers"]  # every layer of every step and validation
    # ConfigChecks runs at the callbacks' setup, before CausalLM resolves "auto": "auto" itself is packed-safe
    assert not {"packing_attention", "flash_varlen", "fp16_packing"} & set(checks.problems)
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


def test_trainer_fit_with_torch_varlen_on_cpu_fails_before_the_first_step(tmp_path):
    with pytest.raises(ValueError, match=r"'torch_varlen' cannot run here: torch's varlen kernel runs on CUDA only"):
        _fit(tmp_path, "torch_varlen")


def test_the_varlen_stand_in_refuses_what_the_cuda_kernel_refuses():
    """The stand-in's checks are the CUDA kernel's (``mha_varlen_fwd``): fp32, mixed dtypes, int64 offsets."""
    from _flash_reference import check_flash_varlen_inputs

    q = torch.randn(6, 4, 8, dtype=torch.bfloat16)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    check_flash_varlen_inputs(q, q, q, cu, cu, 4, 4)
    for args, message in [
        ((q.float(), q.float(), q.float(), cu, cu), "only support fp16 and bf16"),
        ((q, q.float(), q, cu, cu), "query and key must have the same dtype"),
        ((q, q, q.half(), cu, cu), "query and value must have the same dtype"),
        ((q, q, q, cu.long(), cu.long()), "cu_seqlens_q must have dtype int32"),
        ((q.transpose(0, 2).contiguous().transpose(0, 2), q, q, cu, cu), "contiguous last dimension"),
        ((q[..., :6], q[..., :6], q[..., :6], cu, cu), "multiple of 8"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            check_flash_varlen_inputs(*args, 4, 4)


def test_torch_varlen_under_bf16_autocast_casts_rotary_fp32_query_and_key_back(monkeypatch):
    """Rotary embeddings under autocast hand q, k in fp32 and v in bf16: the kernel gets all three in bf16, as
    transformers' flash path casts them; without autocast a model in fp32 is refused by name."""
    use_reference_torch_varlen(monkeypatch)
    seen = []
    kernel = TORCH_VARLEN_FORMS["2.12"]

    @functools.wraps(kernel)  # the same signature: the adapter picks its keywords from it
    def recording(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return kernel(q, k, v, *args, **kwargs)

    import torch.nn.attention.varlen as torch_varlen

    monkeypatch.setattr(torch_varlen, "varlen_attn", recording)
    torch.manual_seed(0)
    lm = CausalLM(model_config=TINY["llama"], vocab_size=64, pad_token_id=0, attn_implementation="torch_varlen")
    batch = {"input_ids": torch.randint(4, 64, (2, 16)), "position_ids": torch.arange(16).repeat(2, 1)}
    with _bf16_mixed():
        loss = lm.model(**batch, labels=batch["input_ids"], use_cache=False).loss
    loss.backward()  # the backward runs through the same (cast) tensors
    assert set(seen) == {(torch.bfloat16,) * 3} and len(seen) == TINY["llama"]["num_hidden_layers"]
    assert lm.model.model.layers[0].self_attn.q_proj.weight.grad is not None
    with pytest.raises(ValueError, match=r"'torch_varlen' runs in fp16/bf16 only.*torch.float32.*bf16-mixed"):
        lm.model(**batch, use_cache=False)
