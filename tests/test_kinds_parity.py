"""Every data kind read map-style and as a stream gives the same documents (tokens and labels), the same
statistics after one pass, and the same error for a bad row: both read modes ask the one kind object
(``lightning_seqmem.kinds``). Streams pack on the fly, so both read modes pack here (``strategy="pack"``) and the
rows are compared document by document (packing places them differently: a window against the whole split)."""

import datasets
import pytest

from lightning_seqmem import SeqMemDataModule
from lightning_seqmem.kinds.base import DOCUMENT_STATS

ODD_CONVERSATIONS = {
    5: [{"role": "user", "content": "no answer"}],  # no trained token: dropped and counted
    7: [{"role": "user", "content": "  "}, {"role": "assistant", "content": "   "}],  # whitespace-only turns
}


def _conversation(i):
    if i in ODD_CONVERSATIONS:
        return ODD_CONVERSATIONS[i]
    turns = [{"role": "system", "content": "Be brief."}]
    for t in range(1 + i % 4):
        turns += [
            {"role": "user", "content": f"question {i}.{t} " * (1 + t)},
            {"role": "assistant", "content": f"answer {i}.{t} " * 3},
        ]
    return turns


KINDS = {
    "text": lambda i: {"text": {4: "   ", 5: "", 6: "\n"}.get(i, f"document {i} " + "words and words " * (i % 9))},
    "prompt_completion": lambda i: (
        {"prompt": f"prompt {i} " * (1 + i % 5), "completion": f"answer {i} " * (i % 4)}
        if i != 5
        else {"prompt": "   ", "completion": "\n"}  # whitespace only
    ),
    "conversations": lambda i: {"messages": _conversation(i)},
    "tokens": lambda i: {
        "input_ids": [5 + (i * 7 + j) % 50 for j in range(i % 13)],
        "labels": [-100] + [5 + (i * 7 + j) % 50 for j in range(1, i % 13)] if i % 13 else [],
    },
    "prompt_completion_tokens": lambda i: {
        "prompt_ids": [7 + j for j in range(1 + i % 20)],
        "completion_ids": [9 + j for j in range(i % 6)],
    },
}
BAD = {  # one bad row (row 3) and the message both read modes give
    "text": ({"text": None}, TypeError, r"Row 3 of split 'train', column 'text' is NoneType"),
    "prompt_completion": (
        {"prompt": "p", "completion": None},
        TypeError,
        r"Row 3 of split 'train', column 'completion' is NoneType",
    ),
    "conversations": (
        {"messages": [{"role": "wizard", "content": "x"}]},
        ValueError,
        r"Conversation 3, turn 0 has role 'wizard'",
    ),
    "tokens": (
        {"input_ids": [1, 10**6], "labels": [1, 2]},
        ValueError,
        r"Row 3 of split 'train', column 'input_ids' holds a token id outside",
    ),
    "prompt_completion_tokens": (
        {"prompt_ids": [1], "completion_ids": [-4]},
        ValueError,
        r"Row 3 of split 'train', column 'completion_ids' holds a token id outside",
    ),
}
ARGS = {"prompt_completion": {"max_prompt_length": 12}, "prompt_completion_tokens": {"max_prompt_length": 12}}


def _datamodule(rows, kind, stream, chat_tokenizer):
    train = datasets.Dataset.from_list(rows)
    data = datasets.DatasetDict({"train": train, "validation": datasets.Dataset.from_list(rows[:6])})
    if stream:
        data = datasets.IterableDatasetDict({split: ds.to_iterable_dataset() for split, ds in data.items()})
    return SeqMemDataModule(
        dataset=data,
        tokenizer=chat_tokenizer,
        strategy="pack",
        max_length=48,
        micro_batch_size=2,
        streaming_buffer_size=1000,
        **ARGS.get(kind, {}),
    )


def _documents(dm):
    """Every packed document of one pass over the train loader: ``(input_ids, labels)`` after its first token (the
    first label of a packed document is always -100)."""
    out = []
    for batch in dm.train_dataloader():
        for ids, labels, positions in zip(batch["input_ids"], batch["labels"], batch["position_ids"]):
            starts = [j for j, p in enumerate(positions.tolist()) if p == 0] + [len(ids)]
            for a, b in zip(starts[:-1], starts[1:]):
                if (labels[a:b] != -100).any() or ids[a:b].ne(dm.pad_token_id).any():
                    out.append((tuple(ids[a:b].tolist()), tuple(labels[a + 1 : b].tolist())))
    return sorted(out)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_map_style_and_stream_give_the_same_rows_stats_and_errors(kind, chat_tokenizer):
    rows = [KINDS[kind](i) for i in range(40)]
    dms = {stream: _datamodule(rows, kind, stream, chat_tokenizer) for stream in (False, True)}
    for dm in dms.values():
        dm.setup("fit")
    map_style, streamed = (dms[s] for s in (False, True))
    assert map_style.read_mode.kind == streamed.read_mode.kind
    assert _documents(map_style) == _documents(streamed)
    keys = DOCUMENT_STATS + map_style.read_mode.kind.stats_keys
    want = {k: map_style.stats()["train"][k] for k in keys}
    assert {k: streamed.stats()["train"][k] for k in keys} == want
    list(streamed.val_dataloader())  # one pass: the validation split's stats agree too
    assert {k: streamed.stats()["validation"][k] for k in keys} == {k: map_style.stats()["validation"][k] for k in keys}
    if kind == "conversations":
        assert want["conversations_dropped_empty"] == 1
    assert want["tokens_truncated"] or kind.startswith("text") or kind == "tokens"  # truncation is compared too

    bad_row, error, message = BAD[kind]
    rows[3] = bad_row
    for stream in (False, True):
        dm = _datamodule(rows, kind, stream, chat_tokenizer)
        with pytest.raises(error, match=message):
            dm.setup("fit")
            list(dm.train_dataloader())
