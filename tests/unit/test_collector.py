"""The collector is paused while a save or load runs on the caller's thread and restored after,
also when it fails, and left off when the caller had turned it off (issue 40)."""
from __future__ import annotations

import gc
import threading

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.common import collector


def test_paused_during_save_and_load_restored_after(tmp_path, monkeypatch):
    seen = []
    import bytecheckpoint.pipeline.save as saving
    original = saving.save
    monkeypatch.setattr(saving, "save", lambda *a, **k: seen.append(gc.isenabled()) or original(*a, **k))
    assert gc.isenabled()
    bcp.save(str(tmp_path / "c"), {"w": torch.ones(3)})
    out = {"w": torch.zeros(3)}
    import bytecheckpoint.pipeline.load as loader
    load = loader.load
    monkeypatch.setattr(loader, "load", lambda *a, **k: seen.append(gc.isenabled()) or load(*a, **k))
    bcp.load(str(tmp_path / "c"), out)
    assert seen == [False, False] and gc.isenabled() and torch.equal(out["w"], torch.ones(3))
    with pytest.raises(bcp.CheckpointError):
        bcp.load(str(tmp_path / "missing"), out)
    assert gc.isenabled()


def test_left_off_when_the_caller_turned_it_off(tmp_path):
    gc.disable()
    try:
        bcp.save(str(tmp_path / "c"), {"w": torch.ones(3)})
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_overlapping_threads_restore_once_the_last_ends():
    inside, release = threading.Event(), threading.Event()

    def hold():
        with collector.paused():
            inside.set()
            release.wait(10)
    t = threading.Thread(target=hold)
    t.start()
    inside.wait(10)
    with collector.paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread's save still runs
    release.set()
    t.join()
    assert gc.isenabled()
