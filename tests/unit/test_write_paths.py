"""A sync save's big files go the way measured faster on their file system, write plus read-back
(storage/write_paths.py, issue 40): buffered unless O_DIRECT's write and first read were measured
and clearly beat the buffered write; never O_DIRECT on its own in a process that only saves
synchronously."""
from __future__ import annotations

import os

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.storage import posix
from bytecheckpoint.storage.write_paths import WritePaths

MiB = 1 << 20


def test_buffered_until_o_direct_was_measured():
    paths = WritePaths()
    for _ in range(5):
        paths.record(False, 100 * MiB, 0.1)
    assert not paths.direct_for_sync()  # no probe: only async saves or direct_io=True measure O_DIRECT


@pytest.mark.parametrize("direct_s, back_s, chosen", [(0.02, 0.04, True), (0.02, 0.07, False), (0.04, 0.04, False)])
def test_o_direct_only_when_its_write_and_read_back_beat_buffered(direct_s, back_s, chosen):
    paths = WritePaths()
    for i in range(3):
        paths.record(False, 100 * MiB, 0.1)
        paths.record(True, 100 * MiB, direct_s, f"/x/{i}.bin")
        assert not paths.direct_for_sync()  # no read-back measured yet: never assumed
    for i in range(3):
        paths.read_back(f"/x/{i}.bin", 100 * MiB, back_s)
    assert paths.direct_for_sync() is chosen


def test_a_slow_read_back_keeps_sync_saves_buffered():
    paths = WritePaths()
    for i in range(3):
        paths.record(False, 100 * MiB, 0.1)
        paths.record(True, 100 * MiB, 0.02, f"/x/{i}.bin")
        paths.read_back(f"/x/{i}.bin", 100 * MiB, 0.02)
    assert paths.direct_for_sync()
    paths.record(True, 100 * MiB, 0.02, "/x/pack-0.bin")
    assert paths.is_cold("/x/pack-0.bin")
    for _ in range(2):
        paths.read_back("/x/pack-0.bin", 40 * MiB, 0.2)   # 5 ms / MiB from the device
    assert paths.is_cold("/x/pack-0.bin")                 # 20 MiB still to read the first time
    paths.read_back("/x/pack-0.bin", 20 * MiB, 0.1)
    assert not paths.is_cold("/x/pack-0.bin") and not paths.direct_for_sync()


def test_a_posix_store_measures_writes_and_first_reads(tmp_path):
    store = posix.PosixStorage(f"file://{tmp_path}", str(tmp_path), direct_io=True)
    data = memoryview(torch.arange(2 * MiB, dtype=torch.uint8).numpy())
    store.write_parts("p/0.bin", [data]).result()
    if store._direct_ok is False or not hasattr(os, "O_DIRECT"):
        pytest.skip("this file system refuses O_DIRECT")
    buffered = posix.PosixStorage(f"file://{tmp_path}", str(tmp_path / "q"))
    assert buffered.paths is store.paths  # one file system, one set of measurements
    buffered.write_parts("q/0.bin", [data]).result()
    out = torch.empty(2 * MiB, dtype=torch.uint8)
    store.read_range_into("p/0.bin", 0, [memoryview(out.numpy())]).result()
    rates = store.paths.rates()
    assert rates["buffered"] and rates["direct"] and rates["read_back"], rates
    assert bytes(out.numpy()) == data.tobytes()


def test_sync_saves_after_async_ones_follow_the_measurement(tmp_path, monkeypatch):
    """An async save measures O_DIRECT; a later sync save writes that way only when the sum says so."""
    from bytecheckpoint.storage import write_paths
    state = {"big": torch.randn(700, 1000)}
    with bcp.Checkpointer() as c:
        c.save(tmp_path / "a", state, async_save=True).wait()
        chosen = []
        decide = write_paths.WritePaths.direct_for_sync
        monkeypatch.setattr(write_paths.WritePaths, "direct_for_sync",
                            lambda self: chosen.append(decide(self)) or chosen[-1])
        c.save(tmp_path / "s", state)
        out = {"big": torch.zeros(700, 1000)}
        c.load(tmp_path / "s", out)
    assert chosen and torch.equal(out["big"], state["big"])
