"""Same tokens as TRL: our ``input_ids`` and trained-token mask equal what TRL 1.16's SFTTrainer prepares with
``assistant_only_loss=True``, on the same conversations, tokenizer and template (built-in, generation markers).

TRL's own data path runs: an ``SFTTrainer`` is built (a one-layer Llama from a config, nothing downloaded) and its
prepared ``train_dataset`` (``input_ids``, ``labels``) is compared row by row.
"""

import numpy as np
import pytest

pytest.importorskip("trl")


def test_input_ids_and_labels_equal_trl_sft_trainer(tmp_path):
    import datasets
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    from lightning_seqmem.data.chat_corpus import SYSTEM_PROMPT, load_builtin_chat_corpus
    from lightning_seqmem.data.chat_template import BUILTIN_CHAT_TEMPLATE, ChatRenderer
    from lightning_seqmem.data.conversations import encode_conversation
    from lightning_seqmem.data.tokenizer import load_tokenizer

    tok = load_tokenizer()
    tok.chat_template = BUILTIN_CHAT_TEMPLATE
    rows = load_builtin_chat_corpus()["validation"][:40]
    assert any(r["messages"][0]["content"] == SYSTEM_PROMPT for r in rows)  # system turns are covered
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    args = SFTConfig(
        output_dir=str(tmp_path), assistant_only_loss=True, report_to="none", max_length=None, use_cpu=True
    )
    trl_rows = SFTTrainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tok
    ).train_dataset

    renderer = ChatRenderer(tok)
    for i, (row, theirs) in enumerate(zip(rows, trl_rows)):
        ours = encode_conversation(row["messages"], renderer, i)
        assert ours.input_ids.tolist() == theirs["input_ids"], i
        assert ours.labels().tolist() == theirs["labels"], i
        assert np.array_equal(ours.trained_mask(), np.asarray(theirs["labels"]) != -100), i
