import ast
import json
import os
import sysconfig
import textwrap
from pathlib import Path

import numpy as np
import pytest

from lightning_seqmem.data.corpus import build_documents, corpus_path, length_percentiles, load_builtin_corpus


@pytest.mark.slow
def test_build_is_deterministic_and_the_cached_corpus_has_splits_text_and_a_heavy_tail(
    tokenizer, tmp_path, monkeypatch, capsys
):
    # The session's corpus, built by another process (conftest's, before the workers start, or an earlier session).
    session = json.loads((corpus_path() / "lightning_seqmem.json").read_text())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    dsd = load_builtin_corpus()
    out = capsys.readouterr().out
    assert "built-in corpus" in out and "p50=" in out  # size and percentiles printed when built
    assert set(dsd) == {"train", "validation"} and dsd["train"].column_names == ["text"]
    assert len(dsd["validation"]) > 0 and len(dsd["train"]) > 10 * len(dsd["validation"])
    cached = tmp_path / "lightning_seqmem"
    [corpus_dir] = [p for p in cached.iterdir() if p.name.startswith("corpus-")]
    meta = json.loads((corpus_dir / "lightning_seqmem.json").read_text())
    # An independent build in another process gave the same documents in the same order: the build is deterministic
    # (across processes, whatever their hash seeds). On a warm cache, a change to the build without a new
    # CORPUS_VERSION fails here too, as it should: users' caches would keep the old corpus under the same name.
    assert meta["fingerprint"] == session["fingerprint"] and meta["documents"] == session["documents"]

    # Loaded again from the cache: identical, and nothing printed.
    again = load_builtin_corpus()
    assert capsys.readouterr().out == ""
    assert list(again["train"]["text"]) == list(dsd["train"]["text"])

    lengths = np.array([len(ids) for ids in tokenizer(list(dsd["train"]["text"]))["input_ids"]])
    assert (lengths > 1024).sum() >= 10  # a tail far beyond a typical max_length
    assert np.median(lengths) < 100  # and many short documents
    assert lengths.max() > 20 * np.median(lengths)


def test_length_percentiles_nearest_rank():
    assert length_percentiles(list(range(1, 101)), qs=(50, 90, 100)) == {50: 50, 90: 90, 100: 100}
    assert length_percentiles([], qs=(50,)) == {50: 0}


def test_the_build_lists_no_skipped_folder_and_walks_no_expression(tmp_path, monkeypatch):
    """The build reads only what can hold a docstring: skipped folders (site-packages under the standard library can
    hold a whole ML stack) are never listed, and no expression node is walked (definitions are statements), yet the
    documents are those of a full ``ast.walk``, in its order."""
    module = textwrap.dedent(
        '''
        """A module docstring, long enough to keep."""
        if True:
            def inner():
                """A function docstring inside an if block."""
        try:
            pass
        except ValueError:
            class Handler:
                """A class docstring inside an except handler."""
        squares = [lambda: i * i for i in range(3)]
        '''
    )
    (tmp_path / "email").mkdir()
    (tmp_path / "email" / "mod.py").write_text(module)
    (tmp_path / "abc.py").write_text('"""Another module docstring to keep."""\n')
    for skipped in ("site-packages/torch", "test", "config-3.11-x86_64-linux-gnu"):
        (tmp_path / skipped).mkdir(parents=True)
        (tmp_path / skipped / "skipped.py").write_text('"""A docstring that is not library text."""\n')
    expected = ["Another module docstring to keep.", '"""Another module docstring to keep."""\n']  # one in eight whole
    expected += [
        ast.get_docstring(node)
        for node in ast.walk(ast.parse(module))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node)
    ]
    assert len(expected) == 5

    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    listed, walked = [], []
    scandir, iter_child_nodes = os.scandir, ast.iter_child_nodes
    monkeypatch.setattr(os, "scandir", lambda path=".": listed.append(Path(path)) or scandir(path))
    monkeypatch.setattr(ast, "iter_child_nodes", lambda node: walked.append(node) or iter_child_nodes(node))
    docs = build_documents()
    monkeypatch.undo()

    assert docs == expected
    assert sorted(p.relative_to(tmp_path).as_posix() for p in listed) == [".", "email"]
    assert walked and not [node for node in walked if isinstance(node, ast.expr)]
