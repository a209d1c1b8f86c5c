"""Token views of Arrow columns: zero-copy, multi-chunk, through indices; every input form packs and collates alike."""

import datasets
import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_seqmem.batching import pack_lengths, pack_sequences
from lightning_seqmem.batching.collate import PackCollator, PadCollator
from lightning_seqmem.data.arrow_gather import ARROW_GATHER_MIN_SEGMENTS, binary_view_of, gather_arrow
from lightning_seqmem.data.tokens import ConcatView, ConstantView, TokenView, as_token_source, view_of_dataset

DOCS = [[5, 6, 7], [], [8], [9, 10, 11, 12, 13], [14, 15], [16, 17, 18, 19]]


def _multi_chunk():
    """Three Arrow chunks (concatenate_datasets keeps each table's chunks)."""
    parts = [datasets.Dataset.from_dict({"input_ids": DOCS[i : i + 2]}) for i in range(0, len(DOCS), 2)]
    return datasets.concatenate_datasets(parts)


def test_views_are_zero_copy_and_read_every_chunk():
    ds = _multi_chunk()
    assert ds.data.column("input_ids").num_chunks == 3
    view = view_of_dataset(ds)
    assert view.lengths.tolist() == [len(d) for d in DOCS] and len(view.chunks) == 3
    assert [view.row(i).tolist() for i in range(len(DOCS))] == DOCS
    arrow_values = ds.data.column("input_ids").chunk(0).values
    assert np.shares_memory(view.chunks[0], np.frombuffer(arrow_values.buffers()[1], dtype=view.chunks[0].dtype))
    # rows of a later chunk, in bulk, as segments (doc, start, length)
    assert view.gather(np.array([3, 5, 0]), np.array([1, 2, 0]), np.array([3, 2, 1])).tolist() == [
        10,
        11,
        12,
        18,
        19,
        5,
    ]


def test_views_follow_a_datasets_indices_mapping():
    ds = _multi_chunk().shuffle(seed=3)  # an indices mapping over the table, no tokens moved
    view = view_of_dataset(ds)
    assert [view.row(i).tolist() for i in range(len(ds))] == [list(r) for r in ds["input_ids"]]


def test_concat_and_constant_views_gather_across_their_parts():
    first, second = TokenView.from_flat(np.array([1, 2, 3, 4]), np.array([0, 2, 4])), as_token_source([[7], [8, 9]])
    both = ConcatView(first, second)
    assert [both.row(i).tolist() for i in range(2)] == [[1, 2, 7], [3, 4, 8, 9]]
    assert both.gather(np.array([1, 0]), np.array([1, 1]), np.array([3, 2])).tolist() == [4, 8, 9, 2, 7]
    labels = ConcatView(ConstantView(-100, first.lengths), second)
    assert labels.row(1).tolist() == [-100, -100, 8, 9]


@pytest.mark.parametrize("form", ["lists", "dataset", "column", "chunked", "list_array", "flat_offsets"])
def test_pack_sequences_takes_every_form_without_python_lists(form):
    ds = _multi_chunk()
    flat = np.array([t for d in DOCS for t in d])
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in DOCS])])
    inputs = {
        "lists": DOCS,
        "dataset": ds,
        "column": ds["input_ids"],
        "chunked": ds.data.column("input_ids"),
        "list_array": pa.array(DOCS),
        "flat_offsets": (flat, offsets),
    }[form]
    res = pack_sequences(inputs, max_length=6)
    ref = pack_sequences(DOCS, max_length=6)
    assert res.rows == ref.rows and res.seq_lengths == ref.seq_lengths
    assert res.input_ids.tolist() == [t for row in ref.rows for t in row]
    assert res.as_arrow().to_pylist() == ref.rows


def test_collators_take_arrow_batches():
    ds = datasets.Dataset.from_dict({"input_ids": DOCS[:3], "labels": [[-100, 6, 7], [], [8]]})
    from_lists = PadCollator(0, pad_to_multiple_of=None)([{"input_ids": d} for d in DOCS[:3]])
    from_arrow = PadCollator(0, pad_to_multiple_of=None)(pa.array(DOCS[:3]))
    assert all(torch.equal(from_lists[k], from_arrow[k]) for k in from_lists)
    with_labels = PadCollator(0, pad_to_multiple_of=None)(ds)
    assert with_labels["labels"].tolist() == [[-100, 6, 7], [-100, -100, -100], [8, -100, -100]]
    packed = PackCollator(0, max_length=8)(pa.array([[1, 2, 3]]))
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]


def _chunked_view(docs, dtype, n_chunks):
    """A ``TokenView`` of ``docs`` stored as ``n_chunks`` Arrow chunks of ``list<dtype>``."""
    parts = np.array_split(np.arange(len(docs)), n_chunks)
    arrow_type = pa.list_(pa.from_numpy_dtype(np.dtype(dtype)))
    return as_token_source(pa.chunked_array([pa.array([docs[i] for i in p], type=arrow_type) for p in parts]))


@settings(max_examples=40, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([np.int8, np.uint16, np.int32, np.int64]), n_chunks=st.integers(1, 4))
def test_arrow_gather_equals_numpy_gather(data, dtype, n_chunks):
    """Whole documents, pieces of them, empty and short (inline) segments, in any order, from any chunk."""
    docs = data.draw(st.lists(st.lists(st.integers(0, 120), max_size=12), min_size=n_chunks, max_size=20))
    view = _chunked_view(docs, dtype, n_chunks)
    doc = np.array(data.draw(st.lists(st.integers(0, len(docs) - 1), max_size=40)), dtype=np.int64)
    start = np.array([data.draw(st.integers(0, len(docs[d]))) for d in doc], dtype=np.int64)
    length = np.array([data.draw(st.integers(0, len(docs[d]) - s)) for d, s in zip(doc, start)], dtype=np.int64)
    chunk, local = view._locate(doc, start)
    binary_view_of(view.chunks, chunk, local, length).validate(full=True)  # a valid Arrow array
    got = gather_arrow(view.chunks, chunk, local, length)
    expected = np.array([t for d, s, n in zip(doc, start, length) for t in docs[d][s : s + n]], dtype=dtype)
    assert got.dtype == np.dtype(dtype) and got.tolist() == expected.tolist()


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("n_chunks", [1, 5])
def test_bulk_pack_gathers_every_token_like_the_row_gather(dtype, n_chunks):
    """``input_ids`` (one Arrow gather over every segment, split documents included) keeps the source dtype and
    equals the rows gathered one by one (numpy views); ``as_arrow`` holds the same rows."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, n).tolist() for n in rng.integers(0, 40, 600)]
    view = _chunked_view(docs, dtype, n_chunks)
    res = pack_sequences(view, max_length=16)  # documents over 16 tokens are split
    assert res.num_rows > ARROW_GATHER_MIN_SEGMENTS and res.documents_split > 0
    by_row = [res.row(r)["input_ids"] for r in range(res.num_rows)]
    assert res.input_ids.dtype == np.dtype(dtype)
    assert res.input_ids.tolist() == [t for row in by_row for t in row]
    assert res.as_arrow().to_pylist() == by_row


def test_bulk_gather_follows_a_shuffled_datasets_indices_mapping():
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 1000, n).tolist() for n in rng.integers(1, 30, 400)]
    parts = [datasets.Dataset.from_dict({"input_ids": docs[i : i + 100]}) for i in range(0, 400, 100)]
    ds = datasets.concatenate_datasets(parts).shuffle(seed=1)
    res = pack_sequences(ds, max_length=20)
    shuffled = [list(r) for r in ds["input_ids"]]
    expected = [
        t for d, a, n in zip(res.segment_doc, res.segment_start, res.segment_length) for t in shuffled[d][a : a + n]
    ]
    assert len(res.segment_doc) >= ARROW_GATHER_MIN_SEGMENTS and res.input_ids.tolist() == expected


@pytest.mark.parametrize("parts", [None, 1, 3, 64])
def test_as_table_holds_trl_columns_gathered_in_parts(parts):
    """``as_table`` gives TRL's ``pack_dataset`` columns; rows gathered on threads in runs of whole rows, in order."""
    rng = np.random.default_rng(2)
    docs = [rng.integers(0, 1000, n).tolist() for n in rng.integers(0, 40, 500)]
    res = pack_sequences(_chunked_view(docs, np.int32, 4), max_length=24)
    table = res.as_table(parts)
    assert table.column_names == ["input_ids", "seq_lengths"]
    by_row = [res.row(r)["input_ids"] for r in range(res.num_rows)]
    assert table.column("input_ids").to_pylist() == by_row
    assert table.column("seq_lengths").to_pylist() == res.seq_lengths
    assert table.column("input_ids").type.value_type == pa.int32()
    assert res.input_ids.size and res.as_table(parts).column("input_ids").to_pylist() == by_row  # over input_ids
    empty = pack_sequences([[], []], max_length=4).as_table(parts)
    assert empty.num_rows == 0 and empty.column("input_ids").to_pylist() == []
    with pytest.raises(ValueError, match="packed from lengths only"):
        pack_lengths([3, 4, 2], max_length=4).as_table(parts)


def test_wrapped_packing_with_eos_gathers_the_separators():
    rng = np.random.default_rng(1)
    docs = [rng.integers(1, 1000, n).tolist() for n in rng.integers(0, 30, 400)]
    res = pack_sequences(_chunked_view(docs, np.int32, 3), max_length=32, packing="wrapped", eos_token_id=0)
    stream = [t for d in docs if d for t in d + [0]]
    assert res.input_ids.tolist() == stream
    assert res.as_arrow().to_pylist() == [stream[i : i + 32] for i in range(0, len(stream), 32)]
    assert res.as_table(3).column("input_ids").to_pylist() == [stream[i : i + 32] for i in range(0, len(stream), 32)]
    plain = pack_sequences(_chunked_view(docs, np.int32, 1), max_length=32, packing="wrapped")
    table = plain.as_table(3)  # the rows are the source's one chunk: no copy
    assert table.column("input_ids").num_chunks == 1 and np.shares_memory(plain.input_ids, plain.source.chunks[0])
    assert table.column("input_ids").to_pylist() == plain.rows


def _as_table_rows(res, queue):
    queue.put(res.as_table(2).column("input_ids").to_pylist())


def test_as_table_works_in_a_forked_child():
    """A DataLoader worker is forked after the parent's gather threads exist: the child makes its own pool."""
    import multiprocessing

    res = pack_sequences([list(range(n)) for n in range(1, 30)], max_length=8)
    expected = res.as_table(2).column("input_ids").to_pylist()  # the parent's pool now exists
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_as_table_rows, args=(res, queue), daemon=True)
    child.start()
    try:
        rows = queue.get(timeout=60)
        child.join(timeout=60)
    finally:
        child.kill()
    assert rows == expected
