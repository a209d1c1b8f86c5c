"""How close is the fake-tensor memory estimate to a real CPU training step? Prints the README table.

    python benchmarks/plan_accuracy.py

For each model (the tiny Llama and GPT-2 presets) and shape, the estimate for device "cpu" (traced on fake
tensors, nothing allocated) is compared with the peak live tensor bytes of the same two training steps run for
real, measured by torch.profiler from every allocation and free of torch's CPU allocator. The QLoRA rows train the
4-bit base as ``memory/qlora_shape.py`` models bitsandbytes' layer (its memory, not its numerics: bitsandbytes does
not train on CPU), a LoRA adapter (r=8, all linear layers) on top. The chunked rows run the loss layer as
``cross_entropy="chunked"`` (512-token chunks) instead of the model's own head and loss.
"""

from __future__ import annotations

import time

from lightning_seqmem.memory.estimate import estimate_training_memory
from lightning_seqmem.memory.measured import measured_training_peak
from lightning_seqmem.memory.stats import format_bytes
from lightning_seqmem.memory.worst_batch import make_dummy_batch
from lightning_seqmem.training.adapters import LoraSettings
from lightning_seqmem.training.building import build_model_config

VOCAB = 4096
PAD_KEYS = ("input_ids", "attention_mask", "labels")
PACK_KEYS = ("input_ids", "labels", "position_ids")
QLORA = LoraSettings(r=8, dropout=0.0, quantize="nf4")
LORA = LoraSettings(r=8, dropout=0.0)

CASES = [
    # (preset, rows, length, keys, precision, attention, checkpointing[, lora[, cross_entropy]])
    *[
        (preset, r, n, PAD_KEYS, "32-true", "sdpa", False)
        for preset in ("tiny_llama", "tiny_gpt2")
        for r, n in ((2, 128), (4, 256), (8, 512))
    ],
    ("tiny_llama", 4, 256, PACK_KEYS, "32-true", "sdpa", False),
    ("tiny_llama", 4, 256, PAD_KEYS, "32-true", "eager", False),
    ("tiny_gpt2", 4, 256, PAD_KEYS, "32-true", "eager", False),
    ("tiny_llama", 4, 256, PAD_KEYS, "bf16-mixed", "sdpa", False),
    ("tiny_gpt2", 4, 256, PAD_KEYS, "bf16-mixed", "sdpa", False),
    ("tiny_llama", 4, 256, PAD_KEYS, "32-true", "sdpa", True),
    ("tiny_llama", 4, 256, PAD_KEYS, "bf16-true", "sdpa", False),
    ("tiny_llama", 4, 256, PAD_KEYS, "32-true", "sdpa", False, QLORA),
    ("tiny_llama", 4, 256, PAD_KEYS, "bf16-mixed", "sdpa", False, QLORA),
    ("tiny_llama", 4, 256, PAD_KEYS, "bf16-true", "sdpa", True, QLORA),
    *[
        ("tiny_llama", 4, 256, PAD_KEYS, precision, "sdpa", checkpointing, lora, "chunked")
        for precision in ("32-true", "bf16-true")
        for lora in (None, LORA)
        for checkpointing in (False, True)
    ],
    ("tiny_llama", 4, 256, PAD_KEYS, "bf16-true", "sdpa", True, QLORA, "chunked"),
]


def main() -> None:
    print(
        "| model | batch (rows x length) | keys | precision | attention | checkpointing | loss | estimate | measured "
        "| error | estimate time |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for preset, rows, length, keys, precision, attention, checkpointing, *extra in CASES:
        lora = extra[0] if extra else None
        cross_entropy = extra[1] if len(extra) > 1 else "full"
        config = build_model_config(preset, VOCAB, 0)
        start = time.perf_counter()
        est = estimate_training_memory(
            config,
            rows,
            length,
            keys,
            precision,
            device="cpu",
            attn_implementation=attention,
            gradient_checkpointing=checkpointing,
            lora=lora,
            cross_entropy=cross_entropy,
        )
        seconds = time.perf_counter() - start
        batch = make_dummy_batch(rows, length, keys, VOCAB)  # padding in a row (pad) or two documents per row (pack)
        real = measured_training_peak(
            config, batch, precision, attention, checkpointing, cross_entropy=cross_entropy, lora=lora
        )
        kind = "pad" if "attention_mask" in keys else "pack"
        name = preset if lora is None else f"{preset} + {'QLoRA' if lora.quantize else 'LoRA'} r={lora.r}"
        print(
            f"| {name} | {rows} x {length} | {kind} | {precision} | {attention} | {'yes' if checkpointing else 'no'} "
            f"| {cross_entropy} | {format_bytes(est.peak)} | {format_bytes(real)} | {100 * (est.peak - real) / real:+.2f}% "
            f"| {seconds:.1f} s |"
        )


if __name__ == "__main__":
    main()
