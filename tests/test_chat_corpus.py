"""The built-in conversational corpus: deterministic, 2 to 13 turns, every conversation has something to learn."""

import pytest

from lightning_seqmem.data.chat_checks import check_conversation
from lightning_seqmem.data.chat_corpus import SYSTEM_PROMPT, conversations_from_documents, load_builtin_chat_corpus


@pytest.mark.slow
def test_builtin_chat_corpus_is_deterministic_and_well_formed():
    corpus = load_builtin_chat_corpus()
    assert corpus == load_builtin_chat_corpus()
    rows = corpus["train"]
    lengths = {len(r["messages"]) for r in rows}
    assert min(lengths) == 2 and max(lengths) == 13
    assert any(r["messages"][0]["content"] == SYSTEM_PROMPT for r in rows)
    for i, row in enumerate(rows):
        check_conversation(row["messages"], i)
        roles = [m["role"] for m in row["messages"] if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
    # Every document of the split is an answer, in order.
    from lightning_seqmem.data.corpus import load_builtin_corpus

    answers = [m["content"] for r in rows for m in r["messages"] if m["role"] == "assistant"]
    assert answers == load_builtin_corpus(verbose=False)["train"]["text"]


def test_source_documents_become_source_requests():
    rows = conversations_from_documents(["import os\nimport sys\ndef f():\n    pass\n"])
    assert rows[0]["messages"][-2]["content"].startswith("Show me the source")
