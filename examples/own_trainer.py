"""Example 1: your own LightningModule and Trainer, with our DataModule and callbacks. Plain Python, no Hydra.

python examples/own_trainer.py --max-steps 100
"""

import argparse

from lightning_seqmem.memory import configure_allocator

configure_allocator()  # before torch is imported: the CUDA allocator reads its settings once

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from lightning_seqmem import SeqLengthWarmup, SeqMemDataModule, StepProgressBar, TokenLossNormalizer  # noqa: E402
from lightning_seqmem.apps.summary import RunSummary  # noqa: E402
from lightning_seqmem.batch import count_label_tokens  # noqa: E402
from lightning_seqmem.memory import CachePreallocator, MemoryMonitor  # noqa: E402


class MyLM(L.LightningModule):
    """Any module that takes our batch dicts: ``input_ids``/``labels`` ``[batch, seq]`` plus ``position_ids``
    (packed) or ``attention_mask`` (padded).

    The loss is token-weighted: every label token of an optimizer step counts the same, whichever micro-batch it is
    in (the warmup's short early batches, the last batch of an epoch, gradient accumulation, DDP ranks). A plain
    per-micro-batch ``.loss`` would weigh a micro-batch of 40 tokens like one of 4,000.
    """

    def __init__(self, vocab_size: int, pad_token_id: int, lr: float = 2e-3) -> None:
        super().__init__()
        config = LlamaConfig(
            vocab_size=vocab_size,
            pad_token_id=pad_token_id,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=4096,
        )
        self.model = LlamaForCausalLM(config)
        self.lr = lr
        self.token_loss = TokenLossNormalizer()  # CachePreallocator's synthetic step leaves it as it was

    def training_step(self, batch, batch_idx):
        # The sum of this micro-batch's token losses over a fixed scale; on_after_backward makes the step's mean.
        loss = self.model(**batch, use_cache=False, num_items_in_batch=self.token_loss.add(batch["labels"])).loss
        self.token_loss.add_loss(loss)  # for logging the step's true per-token loss
        return loss

    def on_after_backward(self):
        loss = self.token_loss.finish_step(self)  # rescales the gradients at the step's last micro-batch
        if loss is not None:
            self.log("train/loss", loss, prog_bar=True, batch_size=1)

    def validation_step(self, batch, batch_idx):
        # Weighted by label tokens, the epoch's value is the per-token mean over the whole validation split.
        tokens = int(count_label_tokens(batch))
        self.log("val/loss", self.model(**batch, use_cache=False).loss, batch_size=max(tokens, 1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--out", default="outputs/own_trainer")
    args = parser.parse_args()

    dm = SeqMemDataModule(max_length=args.max_length, micro_batch_size=8, strategy="pack")  # built-in corpus
    callbacks = [
        SeqLengthWarmup(duration=0.3, max_seq_length=args.max_length),
        CachePreallocator(),
        MemoryMonitor(every_n_steps=25),
        RunSummary(),
        StepProgressBar(),  # counts optimizer steps; plain lines when the output is a log file
    ]
    trainer = L.Trainer(
        max_steps=args.max_steps,
        accumulate_grad_batches=2,  # two micro-batches per step: their tokens weigh the same (token_loss)
        val_check_interval=max(1, args.max_steps // 2),
        limit_val_batches=4,
        callbacks=callbacks,
        default_root_dir=args.out,
        enable_checkpointing=False,
    )
    trainer.fit(MyLM(vocab_size=len(dm.tokenizer), pad_token_id=dm.pad_token_id), datamodule=dm)
