"""The pinned, pipelined load path of device tensors (core/pipeline/device_reads.py), run on the CPU.

The pipeline's logic does not depend on CUDA: these tests route CPU destinations through it
(`staged_destination` patched) with synchronous copies, and check what a GPU load relies on:
the read requests it plans, the bounded slab pool, that a scatter follows every upload of its
chunk, and that a failure in flight is a clear error that leaves no slab held and no thread hung.
CUDA itself is exercised by tests/gpu (skipped without a GPU)."""
from __future__ import annotations

import glob
import os
import random
import threading
import time

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.pipeline import device_reads
from bytecheckpoint.common.errors import CorruptCheckpointError
from bytecheckpoint.storage.errors import StorageError
from bytecheckpoint.storage import faults

MiB = 1 << 20


@pytest.fixture
def staged(monkeypatch):
    """Every destination goes through the pinned-slab pipeline (CPU tensors included)."""
    monkeypatch.setattr(device_reads, "staged_destination", lambda t: True)


def _state(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 * MiB // 4 + 17, generator=g),        # ~3 MiB: split over slabs at 1 MiB blocks
        "mat": torch.randn(512, 300, generator=g),
        "small": [torch.randn(n, generator=g) for n in (1, 7, 100, 4096)],
        "half": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "ints": torch.arange(1000, dtype=torch.int64),
        "scalar": torch.tensor(2.5),
        "step": 7,
    }


def _zeros_like(state):
    return {k: ([torch.zeros_like(t) for t in v] if isinstance(v, list) else
                torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in state.items()}


def _assert_equal(got, want):
    for k, v in want.items():
        if isinstance(v, list):
            for a, b in zip(got[k], v):
                assert torch.equal(a, b), k
        elif isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


# ---------------------------------------------------------------------- planning (pure)

def test_split_range_cuts_at_block_boundaries():
    assert device_reads.split_range(100, 50, 64, 16) == [(100, 50)]
    assert device_reads.split_range(0, 10 * MiB + 5, 4 * MiB, MiB) == [(0, 4 * MiB), (4 * MiB, 4 * MiB),
                                                                        (8 * MiB, 2 * MiB + 5)]
    # a piece starts at a block boundary of its chunk (offsets are relative to the range start)
    pieces = device_reads.split_range(3 * MiB, 9 * MiB, 3 * MiB + 5, MiB)
    assert [o - 3 * MiB for o, _ in pieces] == [0, 3 * MiB, 6 * MiB]
    assert sum(n for _, n in pieces) == 9 * MiB


def test_segments_merge_neighbours_and_stay_within_a_slab():
    pieces = [("p0", 0, 100, "a"), ("p0", 128, 100, "b"), ("p0", 1 << 30, 10, "far"),
              ("p1", 0, 8 * MiB, "whole slab"), ("p0", 256, 8 * MiB - 200, "fills")]
    segs = device_reads.plan_segments(pieces, 8 * MiB)
    assert all(s.stop - s.start <= 8 * MiB for s in segs)
    members = sorted(tuple(p for _, p in s.members) for s in segs)
    assert members == sorted([("a", "b"), ("fills",), ("far",), ("whole slab",)])
    with pytest.raises(bcp.CheckpointError, match="internal"):
        device_reads.plan_segments([("p", 0, 9 * MiB, None)], 8 * MiB)


# ---------------------------------------------------------------------- the pipeline

def test_load_through_slabs_equals_the_saved_state(staged, tmp_path):
    state = _state()
    bcp.save(tmp_path / "c", state)
    with bcp.Checkpointer(pinned_load_bytes=2 * MiB, io_threads=4) as ckpt:
        target = _zeros_like(state)
        ckpt.load(tmp_path / "c", target)
        _assert_equal(target, state)
        stats = ckpt.last_load_stats
        assert stats.pinned_bytes == 2 * MiB, "the slabs are the budget, not the checkpoint's size"
        assert stats.device_bytes == stats.bytes_read > 3.5 * MiB and stats.reads >= 4
        slabs = ckpt._slabs
        assert slabs.in_use == 0 and slabs.peak_in_use <= slabs.count == 2
        # a second load reuses the same slabs (no new page-locked memory)
        ptrs = [s.data_ptr() for s in slabs._slabs]
        ckpt.load(tmp_path / "c", _zeros_like(state))
        assert [s.data_ptr() for s in slabs._slabs] == ptrs


def test_strided_and_partial_destinations_scatter_after_their_uploads(staged, tmp_path, monkeypatch):
    """Destinations that are not one contiguous byte range (a transposed view, a column block of a
    resharded box) land in device scratch and are scattered; a chunk's scatter must come after
    every upload into its scratch, whatever order the workers finish in (random delays here)."""
    full = torch.randn(1024, 1024)                   # 4 MiB: one chunk, 4 checksum blocks, 4 slabs of 1 MiB
    bcp.save(tmp_path / "c", {"w": full, "t": torch.randn(300, 200)})
    events = []
    lock = threading.Lock()
    rng = random.Random(0)

    class Recording(device_reads.HostMover):
        def upload(self, dst, src):
            time.sleep(rng.random() * 0.003)
            with lock:
                events.append(("upload", dst.untyped_storage().data_ptr()))
            super().upload(dst, src)

        def scatter(self, scratch, fn):
            with lock:
                events.append(("scatter", scratch.untyped_storage().data_ptr()))
            super().scatter(scratch, fn)

    monkeypatch.setattr(device_reads, "mover_for", lambda needs, slabs: Recording())
    t_dest = torch.zeros(200, 300).t()               # strided: scratch + scatter
    rows = torch.zeros(300, 1024)                     # rows 500..800 of w: one contiguous byte range, direct
    cols = torch.zeros(1024, 100)                     # a column block: strided in the chunk: scratch + scatter
    with bcp.Checkpointer(pinned_load_bytes=2 * MiB, io_threads=4) as ckpt:
        ckpt.load(tmp_path / "c", {"w": bcp.Shard(rows, (1024, 1024), (500, 0)), "t": t_dest}, strict=False)
        first = list(events)
        events.clear()
        ckpt.load(tmp_path / "c", {"w": bcp.Shard(cols, (1024, 1024), (0, 400))}, strict=False)
        second = list(events)
    assert torch.equal(rows, full[500:800]) and torch.equal(cols, full[:, 400:500])
    for log, scattered in ((first, 1), (second, 1)):
        scatters = [(i, p) for i, (kind, p) in enumerate(log) if kind == "scatter"]
        assert len(scatters) == scattered
        for i, ptr in scatters:
            before = [k for k, p in log[:i] if p == ptr]
            after = [k for k, p in log[i + 1:] if p == ptr]
            assert before and not after, log
    # the column block's chunk came through 4 slab-sized uploads into its scratch, then one scatter
    ptr = [p for kind, p in second if kind == "scatter"][0]
    assert len([k for k, p in second if p == ptr and k == "upload"]) == 4
    # rows 500..800 went straight into the destination (no scratch): an upload into `rows` itself
    assert ("upload", rows.untyped_storage().data_ptr()) in first


def test_the_slab_pool_bounds_reads_in_flight(staged, tmp_path):
    state = {f"t{i}": torch.randn(300_000) for i in range(12)}   # 12 x 1.2 MB: more segments than slabs
    bcp.save(tmp_path / "c", state)
    with bcp.Checkpointer(pinned_load_bytes=2 * MiB, io_threads=8) as ckpt:
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        ckpt.load(tmp_path / "c", target)
        _assert_equal(target, state)
        slabs = ckpt._slabs
        assert slabs.count == 2 and slabs.peak_in_use <= 2 and slabs.in_use == 0
        assert ckpt.last_load_stats.reads >= 6


def _flip_a_byte(path, offset_from_end: int = 1000):
    pack = max(glob.glob(os.path.join(path, "data-*", "pack", "*.bin")), key=os.path.getsize)
    with open(pack, "r+b") as f:
        f.seek(os.path.getsize(pack) - offset_from_end)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_checksum_failure_in_flight_is_a_clear_error_and_frees_every_slab(staged, tmp_path):
    state = {f"t{i}": torch.randn(300_000) for i in range(8)}
    bcp.save(tmp_path / "c", state)
    _flip_a_byte(str(tmp_path / "c"))
    with bcp.Checkpointer(pinned_load_bytes=2 * MiB, io_threads=4) as ckpt:
        with pytest.raises(CorruptCheckpointError, match="fails its crc32 checksum.*partly overwritten"):
            ckpt.load(tmp_path / "c", {k: torch.zeros_like(v) for k, v in state.items()})
        assert ckpt._slabs.in_use == 0
        # the engine is still usable: an intact checkpoint loads through the same slabs
        bcp.save(tmp_path / "ok", state)
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        ckpt.load(tmp_path / "ok", target)
        _assert_equal(target, state)


def test_a_storage_failure_mid_pipeline_fails_the_load_without_hanging(staged, tmp_path):
    state = {f"t{i}": torch.randn(300_000) for i in range(8)}
    bcp.save(tmp_path / "c", state)
    rules = [faults.Fault(op="read", kind="error", key="pack/", skip=2, count=1)]
    with bcp.Checkpointer(pinned_load_bytes=2 * MiB, io_threads=4, fault_rules=rules) as ckpt:
        with pytest.raises((StorageError, bcp.CheckpointError), match="partly overwritten") as info:
            ckpt.load(tmp_path / "c", {k: torch.zeros_like(v) for k, v in state.items()})
        assert "pack/" in str(info.value)
        assert ckpt._slabs.in_use == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("bytecheckpoint-io")]


def test_pinned_load_bytes_zero_keeps_the_host_path(staged, tmp_path):
    state = _state()
    bcp.save(tmp_path / "c", state)
    with bcp.Checkpointer(pinned_load_bytes=0) as ckpt:
        target = _zeros_like(state)
        ckpt.load(tmp_path / "c", target)
        _assert_equal(target, state)
        assert ckpt.last_load_stats.pinned_bytes == 0 and ckpt.last_load_stats.device_bytes == 0
    with pytest.raises(bcp.CheckpointError, match="pinned_load_bytes"):
        bcp.Checkpointer(pinned_load_bytes=-1)


def test_cpu_destinations_never_take_pinned_memory(tmp_path):
    """Without the patch, CPU tensors load on the host path: no slab is allocated."""
    state = _state()
    bcp.save(tmp_path / "c", state)
    with bcp.Checkpointer() as ckpt:
        target = _zeros_like(state)
        ckpt.load(tmp_path / "c", target)
        _assert_equal(target, state)
        assert ckpt.last_load_stats.pinned_bytes == 0
        assert ckpt._slabs is None or ckpt._slabs.nbytes == 0
