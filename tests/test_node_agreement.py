"""Nodes that hold different copies of the data are refused at setup, naming the node and the files; the same data
stored in other files (another cache, another num_proc) passes."""

import json
import os

import datasets
import pytest
from _forked_ranks import run_ranks

from lightning_seqmem.data.node_agreement import check_same_data_across_ranks, mismatch_message, split_digest
from lightning_seqmem.data.token_cache import tokenize_cached
from lightning_seqmem.kinds.text import Text

TEXT = Text()
ROWS = [f"line {i} " + "epsilon " * (i % 7) for i in range(40)]


def _write(path, rows):
    path.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    return path


def _tokenized(path, tokenizer, cache, num_proc=1):
    dsd = datasets.load_dataset("json", data_files=str(path), split=None, cache_dir=str(cache / "hf"))
    return tokenize_cached(dsd, tokenizer, TEXT, num_proc=num_proc, cache_dir=cache, source=str(path))


def test_the_digest_follows_the_data_not_its_files(tmp_path, tokenizer):
    same = _tokenized(_write(tmp_path / "a.jsonl", ROWS), tokenizer, tmp_path / "c1")["train"]
    copy = _tokenized(_write(tmp_path / "b.jsonl", ROWS), tokenizer, tmp_path / "c2", num_proc=2)["train"]
    order = _tokenized(_write(tmp_path / "c.jsonl", ROWS[::-1]), tokenizer, tmp_path / "c3")["train"]
    short = _tokenized(_write(tmp_path / "d.jsonl", ROWS[:-1]), tokenizer, tmp_path / "c4")["train"]
    assert split_digest(same) == split_digest(copy)
    assert len({split_digest(ds)["digest"] for ds in (same, order, short)}) == 3
    assert split_digest(order.select(range(len(order) - 1, -1, -1))) == split_digest(same)  # a view: its rows
    assert split_digest(same.select([])) == {"rows": 0, "digest": split_digest(short.select([]))["digest"]}

    facts = [
        {"host": h, "node": n, "source": s, "splits": {"train": {**split_digest(ds), "files": f}}}
        for h, n, s, ds, f in [("a", "0", "/d/a.jsonl", same, "/c1/x"), ("b", "1", "/d/c.jsonl", order, "/c3/y")]
    ]
    message = mismatch_message(facts)
    assert message.startswith("The train split differs between nodes: rank 1 (node 1, host b) holds 40 rows")
    assert "/d/c.jsonl (files: /c3/y), but rank 0 (node 0, host a)" in message and "/d/a.jsonl" in message
    assert mismatch_message([facts[0], {**facts[0], "host": "c"}]) is None


@pytest.mark.slow
def test_two_ranks_with_node_local_copies_are_refused_when_the_copies_differ(tmp_path, tokenizer):
    """Two gloo ranks, each a node with its own disk (its own copy of the file, its own token cache): equal copies
    pass; a copy in another order stops both ranks with one message naming node 1, its host and its file."""
    for name, rows in (("same", ROWS), ("other", ROWS[::-1])):
        for node in (0, 1):
            folder = tmp_path / name / f"node{node}"
            folder.mkdir(parents=True)
            _write(folder / "train.jsonl", rows if node else ROWS)

    def node(rank: int):
        import torch.distributed as dist

        os.environ["GROUP_RANK"] = str(rank)  # what torchrun sets on each node
        dist.init_process_group("gloo")
        said = []
        for name in ("same", "other"):
            folder = tmp_path / name / f"node{rank}"
            dsd = _tokenized(folder / "train.jsonl", tokenizer, folder / "cache")
            try:
                check_same_data_across_ranks(dsd, source=str(folder / "train.jsonl"))
                said.append(None)
            except ValueError as err:
                said.append(str(err))
        # the same check where a user meets it: the DataModule's setup, on every rank
        from lightning_seqmem import SeqMemDataModule

        folder = tmp_path / "other" / f"node{rank}"
        dm = SeqMemDataModule(str(folder / "train.jsonl"), tokenizer, max_length=32, cache_dir=folder / "cache")
        try:
            dm.setup("fit")
            said.append(None)
        except ValueError as err:
            said.append(str(err))
        dist.destroy_process_group()
        return said

    said = run_ranks(node, timeout=120)
    assert [s[0] for s in said] == [None, None]
    assert said[0][1] == said[1][1]  # every rank stops, with the same message
    message = said[0][1]
    assert message.startswith("The train split differs between nodes: rank 1 (node 1, host ")
    assert f"{tmp_path / 'other' / 'node1' / 'train.jsonl'} (files: {tmp_path / 'other' / 'node1' / 'cache'}" in message
    assert "Every node must hold the same files, in the same order" in message
    assert said[0][2] == said[1][2] and said[0][2].startswith("The train split differs between nodes: rank 1 (node 1")
