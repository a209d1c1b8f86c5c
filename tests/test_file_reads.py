"""Serving rows from a memory-mapped token file with pread: the same tokens as through the map, for documents in
several chunks and through select; no file pages mapped into the process; works in a forked worker and after
pickling."""

import multiprocessing as mp
import pickle
import sys

import datasets
import numpy as np
import pyarrow as pa
import pytest

from lightning_seqmem.data.tokens import ConcatView, ConstantView, TokenView, view_of_dataset

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pread of mapped files: Linux")


def _token_file(tmp_path, docs, batch_docs):
    schema = pa.schema([("input_ids", pa.list_(pa.int32()))])
    path = tmp_path / "tokens.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for lo in range(0, len(docs), batch_docs):
            writer.write_batch(
                pa.record_batch([pa.array(docs[lo : lo + batch_docs], pa.list_(pa.int32()))], schema=schema)
            )
    return datasets.Dataset.from_file(str(path))


def _docs(n, seed=0, longest=3000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50_000, rng.integers(1, longest)).tolist() for _ in range(n)]


def _mapped_reference(view, doc, start, length):
    return np.concatenate(TokenView.pieces(view, doc, start, length))


def _file_rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))


def test_rows_come_from_the_file_and_equal_the_mapped_tokens(tmp_path):
    docs = _docs(300)
    view = view_of_dataset(_token_file(tmp_path, docs, 37)).select(np.arange(299, -1, -1))
    assert view._reader() is not None and len(view.chunks) == 9
    rng = np.random.default_rng(1)
    doc = rng.integers(0, 300, 50)
    start = np.minimum(rng.integers(0, 5, 50), view.lengths[doc] - 1)
    length = np.minimum(rng.integers(0, 400, 50), view.lengths[doc] - start)
    got = view.gather(doc, start, length)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, _mapped_reference(view, doc, start, length))
    np.testing.assert_array_equal(view.row(5), docs[294])


def test_in_memory_tokens_are_read_as_views(tmp_path):
    docs = _docs(20)
    ds = datasets.Dataset.from_dict({"input_ids": docs})
    view = view_of_dataset(ds)
    assert view._reader() is None
    np.testing.assert_array_equal(view.gather(np.array([3, 1])), docs[3] + docs[1])


def test_serving_scattered_rows_maps_no_file_pages(tmp_path):
    docs = _docs(4000, longest=4000)  # ~32 MB of int32 tokens
    view = view_of_dataset(_token_file(tmp_path, docs, 500))
    rng = np.random.default_rng(2)
    before = _file_rss()
    for _ in range(20):
        view.gather(rng.integers(0, 4000, 8))
    served = _file_rss() - before
    mapped_before = _file_rss()
    for _ in range(20):
        doc = rng.integers(0, 4000, 8)
        _mapped_reference(view, doc, np.zeros(8, np.int64), view.lengths[doc])  # reads through the map
    mapped = _file_rss() - mapped_before
    assert served < 1 << 20 and mapped > served  # through the map, each touch maps at least a page


def _worker_rows(view, docs, queue):
    queue.put(view.gather(np.asarray(docs)).tolist())


def test_a_forked_worker_and_a_pickled_copy_read_their_own_files(tmp_path):
    docs = _docs(60)
    view = view_of_dataset(_token_file(tmp_path, docs, 16))
    view.gather(np.array([0]))  # the parent opens its descriptors first
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_worker_rows, args=(view, [7, 40, 59], queue))
    proc.start()
    rows = queue.get(timeout=60)
    proc.join(timeout=60)
    assert rows == docs[7] + docs[40] + docs[59]
    copy = pickle.loads(pickle.dumps(view._reader()))
    assert copy.locations == view._reader().locations and copy._fds == {}


def test_prompt_completion_rows_are_read_from_both_files(tmp_path):
    prompts, completions = _docs(200, seed=3, longest=300), _docs(200, seed=4, longest=300)
    (tmp_path / "p").mkdir(), (tmp_path / "c").mkdir()
    first = view_of_dataset(_token_file(tmp_path / "p", prompts, 23))
    second = view_of_dataset(_token_file(tmp_path / "c", completions, 31))
    both, labels = ConcatView(first, second), ConcatView(ConstantView(-100, first.lengths), second)
    assert first._reader() is not None and second._reader() is not None
    rng = np.random.default_rng(5)
    doc = rng.integers(0, 200, 40)
    start = np.minimum(rng.integers(0, 400, 40), both.lengths[doc])  # some segments start inside the completion
    length = np.minimum(rng.integers(0, 500, 40), both.lengths[doc] - start)
    np.testing.assert_array_equal(both.gather(doc, start, length), np.concatenate(both.pieces(doc, start, length)))
    np.testing.assert_array_equal(both.row(7), prompts[7] + completions[7])
    np.testing.assert_array_equal(labels.row(7), [-100] * len(prompts[7]) + completions[7])
    assert both.gather(np.zeros(0, np.int64)).size == 0
