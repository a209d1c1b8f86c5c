"""Conversations (issue 20 core): checks, masks from generation markers and from prefix differences, empty labels.

Real tokenizers only: the built-in BPE with the built-in template, and a tiny BPE trained here (offline, in
milliseconds) whose end-of-turn token ``<|im_end|>`` is not its EOS ``</s>``.
"""

import warnings

import pytest

from lightning_seqmem.data.chat_checks import check_conversation, check_conversation_columns
from lightning_seqmem.data.chat_template import (
    BUILTIN_CHAT_TEMPLATE,
    MARKERS,
    PREFIX_DIFFERENCE,
    ChatRenderer,
    chat_template_of,
    template_fingerprint,
)
from lightning_seqmem.data.conversations import (
    ConversationSettings,
    EncodedConversation,
    encode_conversation,
    encode_rows,
    select_trained,
)

CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}"
    "{%- else -%}{{- message['content'] + '<|im_end|>' -}}{%- endif -%}"
    "{{- '\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
"""Real ChatML: the end-of-turn token ``<|im_end|>`` differs from EOS; the newline after it is not trained."""


def _without_markers(template: str, tag: str) -> str:
    """The template with its generation markers removed; ``tag`` makes it a new template (the note is once each)."""
    return template.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "") + "{#- " + tag + " -#}"


# Drops the reasoning of every assistant turn but the last, as some reasoning models' templates do.
DROPS_REASONING = CHATML.replace(
    "message['content'] + '<|im_end|>' -}}{%- endgeneration -%}",
    "(message['content'] if loop.last else message['content'].split('</think>')[-1]) + '<|im_end|>' -}}"
    "{%- endgeneration -%}",
)

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is os.path?"},
    {"role": "assistant", "content": "Path helpers."},
    {"role": "user", "content": "And sys?"},
    {"role": "assistant", "content": "Interpreter state."},
]


@pytest.fixture(scope="module")
def chatml_tok():
    """A tiny byte-level BPE with ChatML's special tokens; its EOS ``</s>`` is not the end-of-turn token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for m in CONVERSATION] * 20 + ["<think>hmm</think> user assistant system"] * 20
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHATML
    return fast


def _spans_text(tok, enc: EncodedConversation) -> list[str]:
    return [tok.decode(enc.input_ids[s:e]) for s, e in enc.label_spans]


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "Conversation 7 is empty"),
        ("hello", "Conversation 7 is empty or not a list"),
        ([{"content": "hi"}], "Conversation 7, turn 0 has no 'role'"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant"}], "Conversation 7, turn 1 has no 'content'"),
        ([{"role": "human", "content": "hi"}], "turn 0 has role 'human'; use one of"),
        ([{"role": "user", "content": "hi", "train": "yes"}], "turn 0: 'train' is 'yes'"),
    ],
)
def test_check_conversation_names_row_turn_and_fix(messages, match):
    with pytest.raises(ValueError, match=match):
        check_conversation(messages, 7)


def test_check_conversation_accepts_tool_turns_and_tool_calls_without_content():
    check_conversation(
        [
            {"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [{"name": "f"}]},
            {"role": "tool", "content": "42"},
        ],
        0,
    )


def test_conversation_columns():
    assert check_conversation_columns(["messages", "id"])
    assert not check_conversation_columns(["text"])
    with pytest.raises(ValueError, match=r"'messages' column \(conversations\) and \['text'\]"):
        check_conversation_columns(["messages", "text"])


def test_no_chat_template_says_how_to_set_one():
    from lightning_seqmem.data.tokenizer import load_tokenizer

    tok = load_tokenizer()
    assert tok.chat_template == BUILTIN_CHAT_TEMPLATE  # the built-in tokenizer has one
    tok.chat_template = None
    with pytest.raises(ValueError, match=r"has no chat template.*tokenizer\.chat_template = "):
        ChatRenderer(tok)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="train_on='user' is not valid"):
        ConversationSettings(train_on="user")
    with pytest.raises(ValueError, match="on_empty_labels='skip' is not valid"):
        ConversationSettings(on_empty_labels="skip")


def test_builtin_template_trains_assistant_content_and_its_eos(chat_tokenizer):
    renderer = ChatRenderer(chat_tokenizer)
    assert renderer.method == MARKERS
    enc = encode_conversation(CONVERSATION, renderer, 0)
    assert _spans_text(chat_tokenizer, enc) == ["Path helpers.</s>", "Interpreter state.</s>"]
    assert enc.keep_turns == 1 and len(enc.turn_ends) == 5 and enc.turn_ends[-1] == len(enc.input_ids)
    # The same ids and mask as transformers' own apply_chat_template.
    ref = chat_tokenizer.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert enc.input_ids.tolist() == ref["input_ids"]
    assert enc.trained_mask().astype(int).tolist() == ref["assistant_masks"]
    assert (enc.labels()[enc.trained_mask()] == enc.input_ids[enc.trained_mask()]).all()
    assert (enc.labels()[~enc.trained_mask()] == -100).all()


def test_fallback_equals_markers_and_is_said_once(chat_tokenizer):
    from lightning_seqmem.data.chat_corpus import conversations_from_documents

    marked = ChatRenderer(chat_tokenizer)
    from lightning_seqmem.data.tokenizer import load_tokenizer

    tok = load_tokenizer()
    tok.chat_template = _without_markers(BUILTIN_CHAT_TEMPLATE, "once")
    with pytest.warns(UserWarning, match="no {% generation %} markers: the trained tokens of each turn are found"):
        plain = ChatRenderer(tok)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ChatRenderer(tok).method == PREFIX_DIFFERENCE  # said once per template
    rows = conversations_from_documents(["Return the sum.", "Split a path.\n\nLonger text here.", "Open a file."] * 4)
    for i, row in enumerate(rows):
        a, b = encode_conversation(row["messages"], marked, i), encode_conversation(row["messages"], plain, i)
        assert a.input_ids.tolist() == b.input_ids.tolist()
        assert a.label_spans.tolist() == b.label_spans.tolist()
        assert a.turn_ends.tolist() == b.turn_ends.tolist()


@pytest.mark.parametrize("markers", [True, False])
def test_end_of_turn_differs_from_eos_and_is_trained(chatml_tok, markers):
    tok = chatml_tok
    saved = tok.chat_template
    tok.chat_template = CHATML if markers else _without_markers(CHATML, "eot")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            renderer = ChatRenderer(tok)
        enc = encode_conversation(CONVERSATION, renderer, 0)
    finally:
        tok.chat_template = saved
    end_of_turn = tok.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn != tok.eos_token_id and tok.eos_token_id not in enc.input_ids
    # Every trained span closes its turn (the prefix difference also trains the newline the turn ends with).
    for start, end in enc.label_spans:
        closing = [t for t in enc.input_ids[start:end] if tok.decode([t]).strip()][-1]
        assert closing == end_of_turn
    newline = "" if markers else "\n"
    assert _spans_text(tok, enc) == [f"Path helpers.<|im_end|>{newline}", f"Interpreter state.<|im_end|>{newline}"]


def test_train_on_and_per_message_override(chat_tokenizer):
    renderer = ChatRenderer(chat_tokenizer)
    last = encode_conversation(CONVERSATION, renderer, 0, ConversationSettings(train_on="last_assistant"))
    assert _spans_text(chat_tokenizer, last) == ["Interpreter state.</s>"]
    every = encode_conversation(CONVERSATION, renderer, 0, ConversationSettings(train_on="all"))
    assert every.num_trained == len(every.input_ids)
    messages = [dict(m) for m in CONVERSATION]
    messages[2]["train"] = False  # a bad answer kept as context
    messages[3]["train"] = True  # a user turn worth learning, header and all
    enc = encode_conversation(messages, renderer, 0)
    assert _spans_text(chat_tokenizer, enc) == ["<s>user\nAnd sys?</s>", "Interpreter state.</s>"]
    no_override = encode_conversation(messages, renderer, 0, ConversationSettings(train_field=None))
    assert no_override.label_spans.tolist() == encode_conversation(CONVERSATION, renderer, 0).label_spans.tolist()


def test_fallback_refuses_template_that_rewrites_earlier_turns(chatml_tok):
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>hmm</think>A1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2"},
    ]
    saved = chatml_tok.chat_template
    try:
        chatml_tok.chat_template = _without_markers(DROPS_REASONING, "refuse")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            renderer = ChatRenderer(chatml_tok)
        with pytest.raises(
            ValueError,
            match=r"Conversation 12, turn 1 \(assistant\): the chat template renders it "
            r"differently once later turns follow.*generation",
        ):
            encode_conversation(messages, renderer, 12)
        # With markers the mask is right (transformers' own), the turns it cannot separate are merged into one.
        chatml_tok.chat_template = DROPS_REASONING
        enc = encode_conversation(messages, ChatRenderer(chatml_tok), 12)
        ref = chatml_tok.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert enc.trained_mask().astype(int).tolist() == ref["assistant_masks"]
        assert len(enc.turn_ends) == 3  # user, assistant + user merged, assistant
    finally:
        chatml_tok.chat_template = saved


def test_no_trained_token_is_flagged_then_dropped_kept_or_refused(chat_tokenizer):
    renderer = ChatRenderer(chat_tokenizer)
    rows = [CONVERSATION, [{"role": "user", "content": "Nobody answers."}], CONVERSATION]
    columns = encode_rows(rows, [10, 11, 12], renderer)
    assert columns["num_trained"][1] == 0 and columns["num_trained"][0] > 0
    kept, dropped = select_trained(columns["num_trained"], "drop")
    assert kept.tolist() == [0, 2] and dropped == 1
    kept, dropped = select_trained(columns["num_trained"], "keep")
    assert kept.tolist() == [0, 1, 2] and dropped == 0
    with pytest.raises(ValueError, match=r"1 conversation\(s\) have no trained token \(first: conversation 11\)"):
        select_trained(columns["num_trained"], "error", rows=[10, 11, 12])


def test_rows_are_cheap_arrow_columns(chat_tokenizer):
    import pyarrow as pa

    columns = encode_rows([CONVERSATION, CONVERSATION[:3]], [0, 1], ChatRenderer(chat_tokenizer))
    table = pa.table(columns)
    for name in ("input_ids", "label_spans", "turn_ends"):
        assert table.schema.field(name).type == pa.list_(pa.int32())
    back = EncodedConversation.from_row(table.slice(0, 1).to_pylist()[0])
    enc = encode_conversation(CONVERSATION, ChatRenderer(chat_tokenizer), 0)
    assert back.input_ids.tolist() == enc.input_ids.tolist()
    assert back.label_spans.tolist() == enc.label_spans.tolist() and back.keep_turns == enc.keep_turns


def test_template_fingerprint_changes_with_the_template(chat_tokenizer):
    assert chat_template_of(chat_tokenizer) == BUILTIN_CHAT_TEMPLATE
    assert template_fingerprint(BUILTIN_CHAT_TEMPLATE) != template_fingerprint(CHATML)


def test_fallback_refuses_template_that_cannot_render_a_prefix(chatml_tok):
    saved = chatml_tok.chat_template
    try:  # a template that insists on ending with an assistant turn
        chatml_tok.chat_template = _without_markers(CHATML, "raises") + (
            "{%- if messages[-1]['role'] != 'assistant' -%}{{ raise_exception('end on assistant') }}{%- endif -%}"
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            renderer = ChatRenderer(chatml_tok)
        with pytest.raises(ValueError, match=r"Conversation 3, turn 0 \(system\): the chat template cannot render"):
            encode_conversation(CONVERSATION, renderer, 3)
    finally:
        chatml_tok.chat_template = saved


def test_tool_turns_are_context(chatml_tok):
    messages = [
        {"role": "user", "content": "What is 6 x 7?"},
        {"role": "assistant", "content": "Calling."},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "It is 42."},
    ]
    enc = encode_conversation(messages, ChatRenderer(chatml_tok), 0)
    assert _spans_text(chatml_tok, enc) == ["Calling.<|im_end|>", "It is 42.<|im_end|>"]
    assert len(enc.turn_ends) == 4 and enc.keep_turns == 0
