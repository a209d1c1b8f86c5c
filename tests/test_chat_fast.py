"""The fast conversation path gives what the plain one gives: the template called directly renders what
``render_jinja_template`` renders, and a batch encoded in parts on threads equals each conversation encoded alone."""

import contextlib
import random
import threading

import numpy as np
import pytest

from lightning_seqmem.data import conversations
from lightning_seqmem.data.chat_template import BUILTIN_CHAT_TEMPLATE, ChatRenderer
from lightning_seqmem.data.conversations import ConversationSettings, encode_conversation, encode_rows

NO_MARKERS = BUILTIN_CHAT_TEMPLATE.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
FOLDS_SYSTEM = (  # Llama-2's layout: the system message inside the first user turn
    "{% if messages[0]['role'] == 'system' %}{% set rest = messages[1:] %}{% set sys = messages[0]['content'] %}"
    "{% else %}{% set rest = messages %}{% set sys = '' %}{% endif %}{% for m in rest %}"
    "{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + (sys + ' ' if loop.first and sys else '') + m['content']"
    " + ' [/INST]' }}{% else %}{% generation %}{{ ' ' + m['content'] + eos_token }}{% endgeneration %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ bos_token + '[INST]' }}{% endif %}"
)
WORDS = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "42", "\n", "  ", "ok."]


def _conversations(n: int, seed: int = 0, system: bool = True) -> list[list[dict]]:
    """Random conversations: an optional system turn, 1-4 user/assistant exchanges, odd whitespace and non-ASCII,
    a per-turn ``train`` override now and then."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        messages = [{"role": "system", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 5)))}]
        messages = messages if system and i % 3 else []
        for _ in range(rng.randint(1, 4)):
            messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))})
            answer = {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 30)))}
            if rng.random() < 0.2:
                answer["train"] = rng.random() < 0.5
            messages.append(answer)
        out.append(messages)
    return out


NO_SYSTEM = (  # refuses a system turn, as Gemma's template does
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{{ bos_token + m['role'] + '\n' }}{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] + eos_token }}{% endgeneration %}{% else %}{{ m['content'] + eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ bos_token + 'assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module", params=["markers", "no_markers", "folds_system", "no_system"])
def renderer(request, chat_tokenizer_module):
    template = {
        "markers": BUILTIN_CHAT_TEMPLATE,
        "no_markers": NO_MARKERS,
        "folds_system": FOLDS_SYSTEM,
        "no_system": NO_SYSTEM,
    }
    chat_tokenizer_module.chat_template = template[request.param]
    with pytest.warns(UserWarning) if request.param == "no_markers" else contextlib.nullcontext():
        return ChatRenderer(chat_tokenizer_module)


@pytest.fixture(scope="module")
def chat_tokenizer_module():
    from lightning_seqmem.data.tokenizer import load_tokenizer

    return load_tokenizer()


def test_the_direct_template_call_renders_what_render_jinja_template_renders(renderer):
    """Also for a template that refuses the probe's system turn: it refuses it on both paths alike."""
    assert renderer._direct is not None  # the fast path is in use with this transformers
    for messages in _conversations(30, seed=1, system=renderer.template != NO_SYSTEM):
        for prompt in (False, True):
            for spans in (False, True):
                chat = renderer.prepare(messages)
                assert renderer.render_prepared(chat, prompt, spans) == renderer._render_jinja(
                    [{k: v for k, v in m.items() if v is not None} for m in messages], prompt, spans
                )


@pytest.mark.parametrize("train_on", ["assistant", "last_assistant", "all"])
def test_a_batch_in_parts_on_threads_equals_each_conversation_alone(renderer, train_on, monkeypatch):
    """Several parts per batch (two tokenizing at once), rows in order: ids, spans, turn ends as one at a time."""
    monkeypatch.setattr(conversations, "TOKENIZE_MIN_PART", 3)
    settings = ConversationSettings(train_on=train_on)
    batch = _conversations(41, seed=2, system=renderer.template != NO_SYSTEM)
    rows = list(range(100, 141))
    columns = encode_rows(batch, rows, renderer, settings)
    assert len(columns["input_ids"]) == len(batch)
    # The tokenizing threads end with the batch: a later fork (loader workers, num_proc) copies no running thread.
    assert not [t for t in threading.enumerate() if t.name.startswith("seqmem-tokenize")]
    for i, (messages, row) in enumerate(zip(batch, rows)):
        alone = encode_conversation(messages, renderer, row, settings)
        assert np.array_equal(columns["input_ids"][i], alone.input_ids)
        assert np.array_equal(columns["label_spans"][i], alone.label_spans.reshape(-1))
        assert np.array_equal(columns["turn_ends"][i], alone.turn_ends)
        assert columns["keep_turns"][i] == alone.keep_turns and columns["num_trained"][i] == alone.num_trained


def test_a_bad_conversation_in_a_later_part_is_named(renderer, monkeypatch):
    """The error of a conversation in a later part names its row, whatever is tokenizing meanwhile."""
    monkeypatch.setattr(conversations, "TOKENIZE_MIN_PART", 2)
    batch = _conversations(9, seed=3, system=renderer.template != NO_SYSTEM)
    batch[7] = [{"role": "narrator", "content": "x"}]
    with pytest.raises(ValueError, match="Conversation 57, turn 0 has role 'narrator'"):
        encode_rows(batch, list(range(50, 59)), renderer)


def test_a_tokenizer_without_a_rust_backend_is_called_from_one_thread(chat_tokenizer_module, monkeypatch):
    """A tokenizer's own ``__call__`` (no Rust backend to call) sets state on every call: it is never called from
    two threads at once, and the rows are the same."""
    chat_tokenizer_module.chat_template = BUILTIN_CHAT_TEMPLATE
    renderer = ChatRenderer(chat_tokenizer_module)
    batch = _conversations(20, seed=4)
    expected = encode_rows(batch, list(range(20)), renderer)
    monkeypatch.setattr(renderer, "_backend", None)
    monkeypatch.setattr(conversations, "TOKENIZE_MIN_PART", 2)
    calls, threads = [], set()
    original = type(chat_tokenizer_module).__call__

    def watched(self, *args, **kwargs):
        threads.add(threading.get_ident())
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(chat_tokenizer_module), "__call__", watched)
    columns = encode_rows(batch, list(range(20)), renderer)
    assert len(calls) > 1 and threads == {threading.get_ident()}  # several parts, all in this thread
    for key in ("input_ids", "label_spans", "turn_ends"):
        assert all(np.array_equal(a, b) for a, b in zip(columns[key], expected[key]))
