"""Streaming a Dataset's rows in contiguous shards: the same rows in the same order as the Dataset, for files
(several record batches, several files), in-memory tables, an indices mapping and renamed columns; files are read,
not memory-mapped, so a pass over a large file leaves no file pages resident."""

import os
import sys

import datasets
import pyarrow as pa
import pytest

from lightning_seqmem.data.arrow_stream import iter_shard, plan_shards


def _write(path, texts, batch_rows):
    schema = pa.schema([("text", pa.large_string()), ("other", pa.int64())])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for lo in range(0, len(texts), batch_rows):
            chunk = texts[lo : lo + batch_rows]
            writer.write_batch(
                pa.record_batch(
                    [pa.array(chunk, pa.large_string()), pa.array(range(lo, lo + len(chunk)), pa.int64())],
                    schema=schema,
                )
            )
    return datasets.Dataset.from_file(str(path))


def _streamed(ds, shards, column="text", batch_rows=7):
    out, planned = [], plan_shards(ds, shards)
    assert planned[0].start == 0 and planned[-1].stop == len(ds)
    assert all(a.stop == b.start and a.stop > a.start for a, b in zip(planned, planned[1:]))
    for shard in planned:
        row = shard.start
        for first, batch in iter_shard(ds, shard, [column], batch_rows):
            assert first == row and batch.num_rows <= batch_rows and batch.schema.names == [column]
            out += batch.column(0).to_pylist()
            row += batch.num_rows
        assert row == shard.stop
    return out, planned


def test_files_are_read_in_order_across_batches_files_and_shards(tmp_path):
    texts = [f"doc {i}" for i in range(103)]
    a = _write(tmp_path / "a.arrow", texts[:60], 9)
    b = _write(tmp_path / "b.arrow", texts[60:], 13)
    ds = datasets.concatenate_datasets([a, b])
    for shards in (1, 2, 5, 200):
        out, planned = _streamed(ds, shards)
        assert out == texts
        assert all(s.parts is not None for s in planned)  # read from the files, not through the memory map
        assert len(planned) <= shards


@pytest.mark.parametrize("change", ["in_memory", "shuffle", "select", "rename"])
def test_datasets_a_file_read_cannot_reproduce_are_sliced_from_the_table(tmp_path, change):
    texts = [f"doc {i}" for i in range(50)]
    ds = _write(tmp_path / "a.arrow", texts, 8)
    column = "text"
    if change == "in_memory":
        ds = datasets.Dataset.from_dict({"text": texts})
    elif change == "shuffle":
        ds = ds.shuffle(seed=3)
    elif change == "select":
        ds = ds.select(range(5, 40))
    else:
        ds = ds.rename_column("text", "body")
        column = "body"
    out, planned = _streamed(ds, 3, column)
    assert out == ds[column]
    assert all(s.parts is None for s in planned)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_pass_over_a_file_keeps_its_pages_out_of_resident_memory(tmp_path):
    def file_rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))

    texts = ["word " * 2000] * 4000  # 40 MB of text, in the page cache once written
    ds = _write(tmp_path / "big.arrow", texts, 500)
    size = os.path.getsize(tmp_path / "big.arrow")
    before = file_rss()
    chars = sum(
        len(s)
        for shard in plan_shards(ds, 2)
        for _, b in iter_shard(ds, shard, ["text"], 256)
        for s in b.column(0).to_pylist()
    )
    assert chars == 10_000 * 4000
    assert file_rss() - before < size / 4  # a memory-mapped pass would add the whole file


def test_the_system_pool_is_used_inside_and_the_default_restored_after():
    import pyarrow as pa

    from lightning_seqmem.data.arrow_stream import system_memory_pool

    before = pa.default_memory_pool().backend_name
    with system_memory_pool():
        assert pa.default_memory_pool().backend_name == "system"
        inside = pa.array(list(range(1000)))
    assert pa.default_memory_pool().backend_name == before
    assert inside.sum().as_py() == 499500  # still readable after the switch back
    with pytest.raises(RuntimeError), system_memory_pool():
        raise RuntimeError("a failed pass")
    assert pa.default_memory_pool().backend_name == before
