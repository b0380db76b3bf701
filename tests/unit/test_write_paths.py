"""A sync save's big files go the way measured faster on their file system, write plus read-back
(storage/write_paths.py, issue 40): buffered unless O_DIRECT writes more than twice as fast; one
probe when nothing measured O_DIRECT yet."""
from __future__ import annotations

import os

import pytest
import torch

from bytecheckpoint.storage import posix
from bytecheckpoint.storage.write_paths import WritePaths

MiB = 1 << 20


def test_buffered_until_two_samples_then_one_probe():
    paths = WritePaths()
    assert not paths.direct_for_sync()
    paths.record(False, 100 * MiB, 0.1)
    assert not paths.direct_for_sync()
    paths.record(False, 100 * MiB, 0.1)
    assert paths.direct_for_sync()          # the probe
    assert not paths.direct_for_sync()      # one file only while it runs


@pytest.mark.parametrize("direct_s, chosen", [(0.04, True), (0.06, False), (0.1, False)])
def test_direct_only_when_write_plus_read_back_is_smaller(direct_s, chosen):
    paths = WritePaths()
    for _ in range(3):
        paths.record(False, 100 * MiB, 0.1)
        paths.record(True, 100 * MiB, direct_s)
    assert paths.direct_for_sync() is chosen


def test_a_posix_store_measures_and_probes(tmp_path):
    store = posix.PosixStorage(f"file://{tmp_path}", str(tmp_path))
    data = memoryview(torch.arange(2 * MiB, dtype=torch.uint8).numpy())
    for i in range(3):
        store.write_parts(f"p/{i}.bin", [data]).result()
    rates = store.paths.rates()
    if not hasattr(os, "O_DIRECT") or store._direct_ok is False:
        pytest.skip("this file system refuses O_DIRECT")
    assert rates["buffered"] and rates["direct"], rates   # two buffered writes, then the probe
    for i in range(3):
        with open(tmp_path / "p" / f"{i}.bin", "rb") as f:
            assert f.read() == data.tobytes()
    small = posix.PosixStorage(f"file://{tmp_path}", str(tmp_path / "q"))
    assert small.paths is store.paths      # one file system, one set of measurements
