"""bcp.latest(directory): the newest committed checkpoint under a directory. Torn, in-progress and
unreadable checkpoints are skipped; the order is the recorded step, then when save() was called,
never the name. (On a real object store: tests/integration/test_latest_s3.py.)"""
from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.checkpointer import default_checkpointer
from bytecheckpoint.storage import faults

pytestmark = pytest.mark.timeout(120)


def _save(path, v, **kw):
    bcp.save(str(path), {"w": torch.full((4,), float(v)), "v": v}, **kw).wait()


def _value(path) -> int:
    out = {"w": torch.zeros(4), "v": 0}
    bcp.load(str(path), out)
    assert torch.equal(out["w"], torch.full((4,), float(out["v"])))
    return out["v"]


def _tear(src, dst):
    """What a save killed before its commit leaves behind: the data, no metadata.json."""
    shutil.copytree(src, dst)
    os.remove(os.path.join(dst, "metadata.json"))


def test_nothing_there_is_none(tmp_path):
    assert bcp.latest(str(tmp_path / "missing")) is None
    assert bcp.latest(str(tmp_path)) is None
    (tmp_path / "notes").mkdir()
    (tmp_path / "file.txt").write_text("x")
    assert bcp.latest(tmp_path) is None


def test_recorded_step_wins_over_name_and_time(tmp_path):
    # step_10 saved first, step_9 later (a rerun of an older step): step 10 is still the newest;
    # sorting names would pick step_9 ('step_9' > 'step_10')
    _save(tmp_path / "step_10", 10, step=10)
    _save(tmp_path / "step_9", 9, step=9)
    got = bcp.latest(str(tmp_path))
    assert got == f"{tmp_path}/step_10"
    assert _value(got) == 10
    # a checkpoint without a recorded step counts as step -1, however recent
    _save(tmp_path / "zzz_no_step", 99)
    assert bcp.latest(str(tmp_path)) == f"{tmp_path}/step_10"


def test_without_steps_the_capture_time_orders(tmp_path):
    for name, v in (("b", 1), ("c", 2), ("a", 3)):  # names out of order on purpose
        _save(tmp_path / name, v)
        time.sleep(0.01)
    assert bcp.latest(str(tmp_path)) == f"{tmp_path}/a"
    # the same step: capture time breaks the tie
    _save(tmp_path / "s1", 4, step=5)
    time.sleep(0.01)
    _save(tmp_path / "s0", 5, step=5)
    assert bcp.latest(str(tmp_path)) == f"{tmp_path}/s0"


def test_torn_newest_is_skipped(tmp_path):
    for s in (1, 2, 3):
        _save(tmp_path / f"step_{s}", s, step=s)
    _tear(tmp_path / "step_3", tmp_path / "step_4")          # killed mid-write: newest name, no commit
    (tmp_path / "step_5").mkdir()                            # killed before writing anything
    got = bcp.latest(str(tmp_path))
    assert got == f"{tmp_path}/step_3" and _value(got) == 3
    with pytest.raises(bcp.IncompleteCheckpointError):
        bcp.load(str(tmp_path / "step_4"), {"w": torch.zeros(4), "v": 0})


def test_unreadable_metadata_is_skipped(tmp_path):
    _save(tmp_path / "step_1", 1, step=1)
    _save(tmp_path / "step_2", 2, step=2)
    md = tmp_path / "step_2" / "metadata.json"
    raw = bytearray(md.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    md.write_bytes(bytes(raw))
    assert bcp.latest(str(tmp_path)) == f"{tmp_path}/step_1"


def test_in_progress_async_save_is_not_latest_until_committed(tmp_path):
    _save(tmp_path / "step_1", 1, step=1)
    ckpt = default_checkpointer()
    with faults.inject({"op": "write", "kind": "slow", "delay_s": 1.5, "key": ""}, checkpointer=ckpt):
        h = bcp.save(str(tmp_path / "step_2"), {"w": torch.full((4,), 2.0), "v": 2}, async_save=True, step=2)
        assert not h.done()
        assert bcp.latest(str(tmp_path)) == f"{tmp_path}/step_1"
        h.wait()
    assert bcp.latest(str(tmp_path)) == f"{tmp_path}/step_2"


def test_overwrite_in_progress_keeps_the_old_one_latest(tmp_path):
    _save(tmp_path / "last", 1, step=1)
    ckpt = default_checkpointer()
    with faults.inject({"op": "write", "kind": "slow", "delay_s": 1.0, "key": ""}, checkpointer=ckpt):
        h = bcp.save(str(tmp_path / "last"), {"w": torch.full((4,), 2.0), "v": 2}, async_save=True, step=2,
                     overwrite=True)
        got = bcp.latest(str(tmp_path))
        assert got == f"{tmp_path}/last"
        h.wait()
    assert _value(bcp.latest(str(tmp_path))) == 2


def test_framework_names(tmp_path):
    # Lightning's ModelCheckpoint names (the plugin records step=global_step); a save_last="link"
    # symlink is not a second candidate
    lit = tmp_path / "lightning"
    _save(lit / "epoch=0-step=9.ckpt", 9, step=9)
    _save(lit / "epoch=1-step=10.ckpt", 10, step=10)
    os.symlink(lit / "epoch=1-step=10.ckpt", lit / "last.ckpt")
    assert bcp.latest(str(lit)) == f"{lit}/epoch=1-step=10.ckpt"
    # Accelerate's automatic naming: checkpoints/checkpoint_<n>/bytecheckpoint; the folders are not
    # checkpoints themselves (Accelerate's own files sit beside the bytecheckpoint part), so
    # latest() of checkpoints/ finds none: load_state() picks the folder (docs/elastic.md)
    acc = tmp_path / "project" / "checkpoints"
    _save(acc / "checkpoint_0" / "bytecheckpoint", 0)
    assert bcp.latest(str(acc)) is None
    assert bcp.latest(str(acc / "checkpoint_0")) == f"{acc}/checkpoint_0/bytecheckpoint"


def test_a_checkpoint_itself_is_its_own_latest(tmp_path):
    _save(tmp_path / "ck", 1)
    assert bcp.latest(str(tmp_path / "ck")) == str(tmp_path / "ck")


def test_keep_last_keeps_what_latest_resumes_from(tmp_path):
    _save(tmp_path / "step_10", 10, step=10)
    time.sleep(0.01)
    _save(tmp_path / "step_9", 9, step=9)       # newer by time, older by step
    report = bcp.keep_last(str(tmp_path), 1)
    assert report.kept == [bcp.latest(str(tmp_path))] == [f"{tmp_path}/step_10"]
    assert report.deleted == [f"{tmp_path}/step_9"]


def test_object_store_prefix(tmp_path):
    # tensorstore's in-memory kvstore: the listing path object stores take (no directories)
    run = "memory://latest-test/run"
    assert bcp.latest(run) is None
    for s in (1, 2):
        _save(f"{run}/step_{s}", s, step=s)
    store = default_checkpointer().storage(f"{run}/step_3")      # torn: data objects, no metadata object
    src = default_checkpointer().storage(f"{run}/step_2")
    for key in src.list():
        if key != "metadata.json":
            store.put(key, src.get(key))
    assert bcp.latest(run) == f"{run}/step_2"
    assert bcp.latest(run + "/") == f"{run}/step_2"


def test_a_step_must_be_an_int(tmp_path):
    with pytest.raises(bcp.CheckpointError, match="step must be an int"):
        bcp.save(str(tmp_path / "x"), {"w": torch.zeros(2)}, step="10")
    with pytest.raises(bcp.CheckpointError, match="directory must be a path"):
        bcp.latest(None)



def test_checkpointer_latest_is_bcp_latest(tmp_path):
    import torch
    with bcp.Checkpointer() as ckpt:
        assert ckpt.latest(tmp_path) is None
        ckpt.save(tmp_path / "a", {"x": torch.ones(1)}, step=3)
        ckpt.save(tmp_path / "b", {"x": torch.ones(1)}, step=2)
        assert ckpt.latest(tmp_path) == bcp.latest(tmp_path)
        assert ckpt.latest(tmp_path).rstrip("/").endswith("a")
    with pytest.raises(bcp.CheckpointerClosedError):
        ckpt.latest(tmp_path)
