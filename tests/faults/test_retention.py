"""keep_last(directory, k): never deletes the newest complete checkpoint, a save in progress, an
unreadable one, or (by default) anything incomplete."""
from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint import keep_last
from bytecheckpoint.storage import faults

import fault_scenarios as fs
from harness import run

pytestmark = pytest.mark.timeout(120)


def _save(path, v):
    bcp.save(str(path), {"w": torch.full((4, 4), float(v)), "step": v}).wait()


def _loads(path, v):
    out = {"w": torch.zeros(4, 4), "step": 0}
    bcp.load(str(path), out)
    return out["step"] == v and torch.equal(out["w"], torch.full((4, 4), float(v)))


def _crash_leftover(src, dst):
    """What a crashed save leaves: data, no metadata.json."""
    shutil.copytree(src, dst)
    os.remove(os.path.join(dst, "metadata.json"))


def test_keeps_newest_k_and_leaves_incomplete_alone(tmp_path):
    run_dir = tmp_path / "run"
    for v in range(1, 6):
        _save(run_dir / f"step-{v}", v)
    _crash_leftover(run_dir / "step-5", run_dir / "step-6")   # newer than everything, but incomplete
    (run_dir / "notes").mkdir()
    report = keep_last(str(run_dir), 2)
    assert [os.path.basename(p) for p in report.kept] == ["step-5", "step-4"]
    assert sorted(os.path.basename(p) for p in report.deleted) == ["step-1", "step-2", "step-3"]
    assert sorted(os.path.basename(p) for p in report.incomplete) == ["notes", "step-6"]
    assert sorted(os.listdir(run_dir)) == ["notes", "step-4", "step-5", "step-6"]
    assert _loads(run_dir / "step-5", 5) and _loads(run_dir / "step-4", 4)
    assert bcp.verify(str(run_dir / "step-5")).ok
    # idempotent
    assert keep_last(str(run_dir), 2).deleted == []


def test_k_must_keep_at_least_one(tmp_path):
    for k in (0, -1, 1.5, True):
        with pytest.raises(bcp.CheckpointError, match="k must be an integer >= 1"):
            keep_last(str(tmp_path), k)
    _save(tmp_path / "a", 1)
    assert keep_last(str(tmp_path), 1).kept == [str(tmp_path / "a")]
    assert _loads(tmp_path / "a", 1)


def test_newest_by_save_time_not_by_name(tmp_path):
    _save(tmp_path / "zzz", 1)
    time.sleep(0.01)
    _save(tmp_path / "aaa", 2)
    report = keep_last(str(tmp_path), 1)
    assert report.kept == [str(tmp_path / "aaa")] and report.deleted == [str(tmp_path / "zzz")]


def test_dry_run_deletes_nothing(tmp_path):
    for v in (1, 2, 3):
        _save(tmp_path / f"s{v}", v)
    report = keep_last(str(tmp_path), 1, dry_run=True)
    assert len(report.deleted) == 2 and sorted(os.listdir(tmp_path)) == ["s1", "s2", "s3"]


def test_unreadable_metadata_is_reported_not_deleted(tmp_path):
    for v in (1, 2, 3):
        _save(tmp_path / f"s{v}", v)
    with open(tmp_path / "s1" / "metadata.json", "r+b") as f:
        f.seek(20)
        f.write(b"#")
    report = keep_last(str(tmp_path), 1)
    assert report.unreadable == [str(tmp_path / "s1")]
    assert os.path.exists(tmp_path / "s1" / "metadata.json")
    assert report.deleted == [str(tmp_path / "s2")]


def test_in_flight_async_save_target_is_never_deleted(tmp_path):
    """An async overwrite of the oldest checkpoint is still writing: keep_last(1) must not delete it."""
    for v in (1, 2):
        _save(tmp_path / f"s{v}", v)
        time.sleep(0.01)
    with faults.inject({"op": "write", "kind": "slow", "delay_s": 0.5, "key": "metadata.json"}, checkpointer=bcp.default_checkpointer()):
        h = bcp.save(str(tmp_path / "s1"), {"w": torch.full((4, 4), 9.0), "step": 9}, async_save=True,
                     overwrite=True)
        report = keep_last(str(tmp_path), 1)
        assert report.in_flight == [str(tmp_path / "s1")]
        assert report.deleted == []
        h.wait()
    assert _loads(tmp_path / "s1", 9)
    report = keep_last(str(tmp_path), 1)
    assert report.kept == [str(tmp_path / "s1")] and report.deleted == [str(tmp_path / "s2")]


def test_remove_old_crash_leftovers_only_when_asked(tmp_path):
    _save(tmp_path / "s1", 1)
    _crash_leftover(tmp_path / "s1", tmp_path / "crashed")
    old = time.time() - 3600
    for d, _, files in os.walk(tmp_path / "crashed"):
        for f in files:
            os.utime(os.path.join(d, f), (old, old))
    time.sleep(0.01)
    _save(tmp_path / "s2", 2)
    _crash_leftover(tmp_path / "s2", tmp_path / "writing-now")  # fresh: could be a save in progress
    report = keep_last(str(tmp_path), 2)
    assert sorted(os.path.basename(p) for p in report.incomplete) == ["crashed", "writing-now"]
    report = keep_last(str(tmp_path), 2, remove_incomplete_older_than_s=600)
    assert [os.path.basename(p) for p in report.removed_incomplete] == ["crashed"]
    assert sorted(os.listdir(tmp_path)) == ["s1", "s2", "writing-now"]


def test_missing_directory_is_empty(tmp_path):
    report = keep_last(str(tmp_path / "nothing"), 3)
    assert report.kept == report.deleted == []


@pytest.mark.faults
@pytest.mark.timeout(200)
def test_collective_on_two_ranks(tmp_path):
    for v in (1, 2, 3):
        _save(tmp_path / f"s{v}", v)
        time.sleep(0.01)
    outs = run("fault_scenarios:retention_on_ranks", 2, {"directory": str(tmp_path), "k": 1})
    reports = [json.loads(o.split("REPORT ")[1].splitlines()[0]) for o in outs]
    assert reports[0] == reports[1] and len(reports[0]["deleted"]) == 2
    assert sorted(os.listdir(tmp_path)) == ["s3"]
