"""Preference pairs as conversations: the prompt's turns and the chosen/rejected assistant turns rendered with the
tokenizer's chat template, tokenized as TRL 1.16's DPOTrainer does (checked against its own prepared dataset), with
an explicit ``prompt`` column or the shared leading turns as the prompt, through the DataModule to padded and packed
pair batches, and bad turns named by row and column."""

import copy
import json
import warnings

import datasets
import pytest
import torch

from lightning_seqmem import SeqMemDataModule
from lightning_seqmem.batch import count_real_tokens
from lightning_seqmem.data.chat_pairs import ChatPairs, common_prefix, encode_chat_pairs, shared_turns
from lightning_seqmem.data.chat_template import ChatRenderer
from lightning_seqmem.data.encode import batch_encoder
from lightning_seqmem.data.tokenizer import load_tokenizer


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def chat_rows(n=24):
    """Explicit-prompt pairs: a system turn on some, a multi-turn prompt on others, answers of different lengths."""
    rows = []
    for i in range(n):
        prompt = [user(f"How do I sort list number {i}?" + " Be brief." * (i % 3))]
        if i % 4 == 0:
            prompt = [{"role": "system", "content": "You answer Python questions."}] + prompt
        if i % 5 == 1:
            prompt = prompt + [assistant("Which order?"), user("Ascending, please.")]
        rows.append(
            {
                "prompt": prompt,
                "chosen": [assistant("Use sorted(items)." + " It is stable." * (i % 5))],
                "rejected": [assistant("You cannot." + " Sorry." * (i % 2))],
            }
        )
    return rows


def implicit(rows):
    """The same pairs without a prompt column: each side is the whole conversation."""
    return [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in rows]


def test_shared_turns_and_common_prefix():
    a, b = [user("q"), assistant("x")], [user("q"), assistant("y")]
    assert shared_turns(a, b) == 1
    assert shared_turns(a, a) == 1  # identical: each side keeps its last turn (warned later, never empty)
    assert shared_turns([user("q")], [user("r"), assistant("y")]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([1, 2], [1, 2, 3]) == 2


def test_tokens_equal_trl_dpo_trainer(chat_tokenizer, tmp_path):
    trl = pytest.importorskip("trl")
    from transformers import LlamaConfig, LlamaForCausalLM

    rows = chat_rows()
    config = LlamaConfig(
        vocab_size=len(chat_tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model, reference = LlamaForCausalLM(config), LlamaForCausalLM(config)  # from a config: nothing downloaded
    args = trl.DPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_length=None)
    for data, settings in ((rows, ChatPairs()), (implicit(rows), ChatPairs(has_prompt=False))):
        theirs = trl.DPOTrainer(
            model=model,
            ref_model=reference,
            args=args,
            train_dataset=datasets.Dataset.from_list(data),
            processing_class=chat_tokenizer,
        ).train_dataset
        batch = {key: [r[key] for r in data] for key in data[0]}
        renderer = ChatRenderer(chat_tokenizer, masks=False)
        ours = encode_chat_pairs(batch, range(len(data)), renderer, settings, batch_encoder(chat_tokenizer))
        assert ours == encode_chat_pairs(batch, range(len(data)), renderer, settings)  # both encoders agree
        for key in ("prompt_ids", "chosen_ids", "rejected_ids"):
            assert ours[key] == theirs[key], (key, settings)
        eot = chat_tokenizer.eos_token_id
        assert all(ids[-1] == eot for ids in ours["chosen_ids"])  # the closing token of the answer is trained


def test_datamodule_takes_conversation_pairs_from_every_source(chat_tokenizer, tmp_path):
    rows = chat_rows()
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    batches = {}
    for name, source in {
        "list": rows,
        "dataset": datasets.Dataset.from_list(rows),
        "jsonl": str(path),
        "implicit": datasets.Dataset.from_list(implicit(rows)),
    }.items():
        dm = SeqMemDataModule(
            source,
            tokenizer=chat_tokenizer,
            strategy="pad",  # compared with attention masks
            max_length=64,
            micro_batch_size=4,
            eval_batch_size=4,
            cache_dir=tmp_path / "cache",
            seed=0,
        )
        dm.setup("fit")
        stats = dm.stats()["train"]
        assert stats["documents"] + dm.stats()["validation"]["documents"] == 24  # pairs, none lost
        batches[name] = next(iter(dm.val_dataloader()))
    for name, batch in batches.items():
        for key in ("input_ids", "completion_mask", "attention_mask"):
            assert torch.equal(batch[key], batches["dataset"][key]), (name, key)


@pytest.mark.parametrize("strategy", ["pad", "pack"])
def test_padded_and_packed_pairs_carry_the_same_tokens(chat_tokenizer, tmp_path, strategy):
    dm = SeqMemDataModule(
        chat_rows(),
        tokenizer=chat_tokenizer,
        max_length=48,
        max_prompt_length=24,
        strategy=strategy,
        micro_batch_size=4,
        eval_batch_size=4,
        cache_dir=tmp_path / "cache",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dm.setup("fit")
    stats = dm.stats()["train"]
    served = sum(count_real_tokens(b) for b in dm.train_dataloader())
    assert stats["documents"] > 0 and stats["prompt_tokens_truncated"] > 0  # prompts of several turns were cut
    assert served == stats["tokens"] - stats["tokens_truncated"] - stats["tokens_dropped"]


def test_bad_turns_name_the_row_and_column(chat_tokenizer, tmp_path):
    rows = chat_rows(8)
    rows[5]["rejected"] = [{"role": "assistant"}]
    with pytest.raises(ValueError, match=r"Conversation 5 \(column 'rejected'\), turn 0 has no 'content'"):
        SeqMemDataModule(
            datasets.DatasetDict(train=datasets.Dataset.from_list(rows)),
            tokenizer=chat_tokenizer,
            max_length=64,
            cache_dir=tmp_path / "cache",
        ).setup("fit")
    rows = chat_rows(8)
    rows[2]["chosen"] = [{"role": "bot", "content": "x"}]
    with pytest.raises(ValueError, match=r"Conversation 2 \(column 'chosen'\), turn 0 has role 'bot'"):
        SeqMemDataModule(
            datasets.DatasetDict(train=datasets.Dataset.from_list(rows)),
            tokenizer=chat_tokenizer,
            max_length=64,
            cache_dir=tmp_path / "cache",
        ).setup("fit")
    plain = load_tokenizer()  # no chat template: say how to set one
    plain.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        SeqMemDataModule(chat_rows(8), tokenizer=plain, max_length=64, cache_dir=tmp_path / "cache").setup("fit")


def test_a_generation_prompt_the_full_sequence_does_not_repeat_is_cut_where_they_part(chat_tokenizer):
    """A template whose generation prompt writes more than the assistant turn's start (an empty thought block):
    as TRL does, each completion starts where the prompt's tokens and the full sequence part, with a warning
    naming the pairs."""
    from lightning_seqmem.data.chat_template import BUILTIN_CHAT_TEMPLATE

    tok = copy.deepcopy(chat_tokenizer)
    tok.chat_template = BUILTIN_CHAT_TEMPLATE.replace(
        "bos_token + 'assistant\n' -}}{%- endif", "bos_token + 'assistant\nthink\n' -}}{%- endif"
    )
    rows = chat_rows(4)
    batch = {key: [r[key] for r in rows] for key in rows[0]}
    renderer = ChatRenderer(tok, masks=False)
    with pytest.warns(UserWarning, match=r"Pairs \[0, 1, 2, 3\]: the prompt rendered with the generation prompt"):
        out = encode_chat_pairs(batch, range(4), renderer, ChatPairs())
    for i, row in enumerate(rows):
        full = renderer.tokenize(renderer.render(row["prompt"] + row["chosen"], spans=False)[0])[0].tolist()
        generation = renderer.tokenize(renderer.render(row["prompt"], True, spans=False)[0])[0].tolist()
        assert out["prompt_ids"][i] + out["chosen_ids"][i] == full  # nothing of the sequence is lost
        assert len(out["prompt_ids"][i]) < len(generation)  # the thought block is not part of the prompt


def test_seqmem_plan_plans_conversation_pairs_as_the_datamodule_serves_them(chat_tokenizer, tmp_path):
    from lightning_seqmem.apps.planner import plan

    arguments = dict(
        tokenizer=chat_tokenizer,
        max_length=48,
        max_prompt_length=24,
        micro_batch_size=4,
        strategy="pack",
        cache_dir=tmp_path / "cache",
    )
    result = plan(SeqMemDataModule(chat_rows(), **arguments), None, strategies=["pack"], max_lengths=[48])
    dm = SeqMemDataModule(chat_rows(), **arguments)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dm.setup("fit")
    stats, mine = dm.stats()["train"], result.configured
    assert (mine.token_efficiency, mine.rows, mine.tokens) == (
        stats["token_efficiency"],
        stats["rows"],
        stats["tokens"],
    )
    assert mine.max_batch_shape == dm.max_batch_shape() == (4, 96)  # rows of 2 * max_length
