"""Format 2 block checksums: a load that needs part of a chunk reads only the blocks holding it,
and every byte it reads is still checked (a flipped byte inside the range is caught; one outside
is not read by that load, and verify() finds it)."""
import json

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.storage import chunks

ROWS, COLS = 64, 256          # one 64 KiB float32 chunk; 4 KiB blocks = 4 rows each


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(chunks, "BLOCK_BYTES", 4096)


def _saved(tmp_path):
    full = torch.randn(ROWS, COLS)
    bcp.save(tmp_path / "ck", {"w": full})
    body = json.loads((tmp_path / "ck" / "metadata.json").read_text())
    (arr,) = body["arrays"].values()
    assert arr["block_bytes"] == 4096 and arr["chunks"] == [ROWS, COLS]
    (meta,) = bcp.Checkpointer().metadata(tmp_path / "ck").arrays.values()
    key, offset = chunks.chunk_location(meta, (0, 0))   # format 5: the chunk inside a pack file
    return full, (tmp_path / "ck" / key, offset)


@pytest.fixture(params=["posix", "tensorstore"])
def local_io(request):
    """Both storage implementations: plain files, and tensorstore's kvstore (what s3:// and gs://
    use for range reads)."""
    return request.param


def _load_rows(root, lo, hi, local_io="posix"):
    ck = bcp.Checkpointer(local_io=local_io)
    part = bcp.Shard(torch.zeros(hi - lo, COLS), (ROWS, COLS), (lo, 0))
    ck.load(root, {"w": part})
    return part.local, ck.last_load_stats


def _flip(chunk, offset):
    path, base = chunk
    raw = bytearray(path.read_bytes())
    raw[base + offset] ^= 0x10
    path.write_bytes(bytes(raw))


def test_range_read_reads_only_covering_blocks_and_checks_them(tmp_path, small_blocks, local_io):
    full, chunk = _saved(tmp_path)
    got, stats = _load_rows(tmp_path / "ck", 10, 20, local_io)       # rows 10..19 -> blocks 2..4 (rows 8..19)
    assert torch.equal(got, full[10:20])
    assert stats.bytes_read == 3 * 4096
    got, stats = _load_rows(tmp_path / "ck", 0, ROWS, local_io)      # the whole chunk, straight into the target
    assert torch.equal(got, full) and stats.bytes_read == ROWS * COLS * 4

    # a flipped byte in row 9 (inside block 2, outside the rows wanted, inside the bytes read)
    _flip(chunk, 9 * COLS * 4 + 3)
    with pytest.raises(bcp.CorruptCheckpointError, match="crc32"):
        _load_rows(tmp_path / "ck", 10, 20, local_io)


def test_flip_outside_the_range_is_not_read_but_verify_finds_it(tmp_path, small_blocks):
    full, chunk = _saved(tmp_path)
    _flip(chunk, 50 * COLS * 4)                            # row 50, block 12
    got, stats = _load_rows(tmp_path / "ck", 10, 20)
    assert torch.equal(got, full[10:20]) and stats.bytes_read == 3 * 4096
    report = bcp.verify(tmp_path / "ck")
    assert not report.ok and "crc32" in report.problems[0]
    with pytest.raises(bcp.CorruptCheckpointError):
        _load_rows(tmp_path / "ck", 40, 60)


def test_non_contiguous_part_is_read_through_a_buffer_and_checked(tmp_path, small_blocks):
    full, chunk = _saved(tmp_path)
    part = bcp.Shard(torch.zeros(6, 100), (ROWS, COLS), (30, 50))   # a column slice of rows 30..35
    bcp.load(tmp_path / "ck", {"w": part})
    assert torch.equal(part.local, full[30:36, 50:150])
    _flip(chunk, 33 * COLS * 4 + 4 * 200)                   # row 33, column 200: read (same block), not wanted
    with pytest.raises(bcp.CorruptCheckpointError):
        bcp.load(tmp_path / "ck", {"w": bcp.Shard(torch.zeros(6, 100), (ROWS, COLS), (30, 50))})


def test_truncated_chunk_is_caught_by_a_range_read(tmp_path, small_blocks, local_io):
    _, (path, base) = _saved(tmp_path)
    path.write_bytes(path.read_bytes()[: base + 40 * COLS * 4])
    with pytest.raises(bcp.CorruptCheckpointError, match="shorter|damaged"):
        _load_rows(tmp_path / "ck", 36, 48, local_io)


def test_block_checksums_match_zlib():
    import zlib
    data = memoryview(bytes(range(256)) * 100)
    assert chunks.block_checksums(data, 1000) == tuple(zlib.crc32(data[i:i + 1000]) for i in range(0, len(data), 1000))
    parts = [data[:333], data[333:2500], data[2500:]]
    assert tuple(chunks._stream_blocks(parts, 1000)) == chunks.block_checksums(data, 1000)


def test_reading_checksum_tables_leaves_the_warnings_filters_alone():
    """Filters are process-wide: a parse on an async commit thread must not make another thread's
    warnings raise (a DeepSpeed FutureWarning in training did, while a commit parsed names)."""
    import threading
    import warnings

    import numpy as np

    from bytecheckpoint.format import checksums as cs
    counts = (4, 3)
    table = {f"{i}.{j}": (i * 3 + j,) for i in range(4) for j in range(3)}
    seen = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(list(warnings.filters[:1]))

    before = list(warnings.filters)
    t = threading.Thread(target=watch)
    t.start()
    try:
        for _ in range(200):
            assert cs._pack_parsed(counts, table, 1) is not None
            assert cs._pack_parsed(counts, {**{k: v for k, v in list(table.items())[:-1]}, "3.x": (1,)}, 1) is None
    finally:
        stop.set()
        t.join()
    assert list(warnings.filters) == before
    assert all(f == before[:1] for f in seen), "another thread saw a changed warnings filter"
    assert np.array_equal(cs._pack_parsed(counts, table, 1), np.arange(12, dtype="<u4"))
