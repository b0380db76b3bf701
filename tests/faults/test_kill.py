"""kill -9 of one rank, or of every rank, at random moments of sync and async saves (2 gloo ranks).

After each kill: the previous checkpoint loads exactly and verifies; what the killed save left is
either nothing, an incomplete checkpoint that never loads and that inspect/verify/CLI report as
incomplete, or (killed after the commit) a complete one that loads exactly and verifies; and a
later save to a new path succeeds. Surviving ranks must exit with an error by themselves (no
rank waits forever for a dead peer).

Fast subset (make test): one trial per mode. Long trials (make test-faults, marker `faults`):
BCP_KILL_TRIALS per mode (default 20), i.e. >= 80 kills, plus overwrite-in-place trials.
"""
from __future__ import annotations

import collections
import json
import os
import random
import re
import time

import pytest

import bytecheckpoint as bcp

import fault_scenarios as fs
from harness import Job, judge, kill_when_ready, run

WORLD = 2
SURVIVOR_EXIT_S = 45.0       # survivors must notice the dead peer and exit by themselves within this
TRIALS = int(os.environ.get("BCP_KILL_TRIALS", "20"))
SEED = int(os.environ.get("BCP_KILL_SEED", str(int(time.time()) % 100000)))
SCALE = 4                    # 6 x 1 MiB row-sharded tensors + small ones: ~3 MiB per rank


def _save_seconds(outputs) -> float:
    times = [float(m) for o in outputs for m in re.findall(r"SAVE_S ([0-9.]+)", o)]
    return max(times) if times else 0.5


def _report(name: str, stats) -> None:
    path = os.environ.get("BCP_FAULT_REPORT")
    line = json.dumps({"test": name, "seed": SEED, **stats})
    print(line)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def kill_trials(tmp_path, plan, *, overwrite: bool = False, name: str = "kill_trials", final_check: bool = True):
    """plan: one (async_save, victims) per trial, victims 'one' or 'all'."""
    rng = random.Random(f"{SEED}-{name}-{overwrite}")
    prev = str(tmp_path / "prev")
    calib = _save_seconds(run("fault_scenarios:save_version", WORLD, {"path": prev, "version": 1, "scale": SCALE}))
    window = max(0.05, (3.0 if overwrite else 1.3) * calib)  # an overwrite also deletes the old data
    outcomes = collections.Counter()
    survivors_errored = survivor_checks = 0
    version = 1
    for i, (async_save, victims) in enumerate(plan):
        target = prev if overwrite else str(tmp_path / f"trial{i}")
        markers = tmp_path / f"markers{i}"
        markers.mkdir()
        new_version = 100 + i
        job = Job("fault_scenarios:save_version", WORLD,
                  {"path": target, "version": new_version, "async_save": async_save, "overwrite": overwrite,
                   "marker_dir": str(markers), "scale": SCALE})
        checked, errored = kill_when_ready(job, str(markers), rng, window, victims, SURVIVOR_EXIT_S, i)
        survivor_checks += checked
        survivors_errored += errored
        mode = f"{'async' if async_save else 'sync'}-{victims}"
        if overwrite:
            # the path holds either the old or the new checkpoint, whole
            committed_new = _loads_as(target, new_version)
            assert committed_new or _loads_as(target, version), f"trial {i}: {target} loads as neither version"
            assert bcp.verify(target).ok, f"trial {i}: {bcp.verify(target).problems[:3]}"
            outcomes[f"{mode}:{'new' if committed_new else 'old'}"] += 1
            version = new_version if committed_new else version
        else:
            outcome = judge(target, new_version, scale=SCALE)
            assert not outcome.problems, f"trial {i} ({outcome.kind}): {outcome.problems}\n{job.describe()}"
            outcomes[f"{mode}:{outcome.kind}"] += 1
            # the previous checkpoint is intact
            fs.load_and_check(prev, version, SCALE)
            assert bcp.verify(prev).ok
        # a later save to a new path succeeds (in this process; the 2-rank case is checked below)
        later = str(tmp_path / f"later{i}")
        bcp.save(later, fs.build_state(new_version, 0, 1))
        fs.load_and_check(later, new_version)
    # after the crashes, a 2-rank save to a new path and onto a crashed save's own path works
    partial = None if not final_check else next((str(tmp_path / f"trial{i}") for i in range(len(plan))
                    if not overwrite and not bcp.is_checkpoint(str(tmp_path / f"trial{i}"))), None)
    if final_check:
        outs = run("fault_scenarios:save_then_load", WORLD,
                   {"paths": [str(tmp_path / "final")] + ([partial] if partial else []), "version": 999})
        assert all(o.count("SAVE_LOAD_OK") == (2 if partial else 1) for o in outs)
    _report(name, {"overwrite": overwrite, "trials": len(plan), "outcomes": dict(sorted(outcomes.items())),
                   "survivor_checks": survivor_checks, "survivors_exited_with_error": survivors_errored,
                   "kill_window_s": round(window, 3)})
    return outcomes


def _loads_as(path, version) -> bool:
    try:
        fs.load_and_check(path, version, SCALE)
        return True
    except AssertionError:
        return False


MODES = [(False, "one"), (False, "all"), (True, "one"), (True, "all")]
IDS = ["sync-one", "sync-all", "async-one", "async-all"]


@pytest.mark.timeout(240)
def test_kill_fast_subset(tmp_path):
    """Two kills for `make test`: one rank of a sync save, every rank of an async save."""
    kill_trials(tmp_path, [(False, "one"), (True, "all")], name="kill_fast", final_check=False)


@pytest.mark.faults
@pytest.mark.timeout(3000)
@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_kill_trials(tmp_path, mode):
    outcomes = kill_trials(tmp_path, [mode] * TRIALS, name=f"kill_{IDS[MODES.index(mode)]}")
    assert sum(outcomes.values()) == TRIALS


@pytest.mark.faults
@pytest.mark.timeout(3000)
def test_kill_while_overwriting_in_place(tmp_path):
    """overwrite=True onto the previous checkpoint's own path: after any kill the path loads as
    exactly the old or exactly the new version, never a mix, and verifies."""
    n = max(4, TRIALS // 2)
    plan = [(bool(i % 2), "one") for i in range(n)]
    outcomes = kill_trials(tmp_path, plan, overwrite=True, name="kill_overwrite")
    assert sum(outcomes.values()) == n


# ---------------------------------------------------------------------- exact kill points
# SIGKILL from inside the storage layer at chosen requests (BCP_FAULTS kind "kill"), so the
# interesting moments are hit every time, not by chance.
POINTS = {
    "mid-data": ({"op": "write", "kind": "kill", "key": "/pack/", "rank": 1}, False, "incomplete"),
    "before-commit": ({"op": "write", "kind": "kill", "key": "metadata.json", "rank": 0}, False, "incomplete"),
    "async-objects": ({"op": "write", "kind": "kill", "key": "objects/", "rank": 1}, True, "incomplete"),
    "async-before-commit": ({"op": "write", "kind": "kill", "key": "metadata.json", "rank": 0}, True, "incomplete"),
    # overwrite=True in place: killed after the new metadata is written, while deleting the old data
    "overwrite-after-commit": ({"op": "delete", "kind": "kill", "key": "data-", "rank": 0}, False, "complete"),
}


def _kill_at(tmp_path, point):
    rule, async_save, expected = POINTS[point]
    prev = str(tmp_path / "prev")
    in_place = point.startswith("overwrite")
    target = prev if in_place else str(tmp_path / "target")
    env = {"BCP_FAULTS": json.dumps([rule])}
    job = Job("fault_scenarios:save_two", WORLD, {"first": prev, "second": target, "async_save": async_save,
                                                   "scale": SCALE, "overwrite": in_place}, env=env)
    codes = job.finish(120)
    killed = rule["rank"]
    assert codes[killed] == -9, f"{point}: rank {killed} was not killed at the fault point:\n{job.describe()}"
    assert codes[1 - killed] not in (0, None), f"{point}: the survivor did not fail:\n{job.describe()}"
    outcome = judge(target, 2, scale=SCALE)
    assert outcome.kind == expected and not outcome.problems, (outcome, job.describe())
    if not in_place:
        fs.load_and_check(prev, 1, SCALE)
        assert bcp.verify(prev).ok
    return outcome


@pytest.mark.timeout(240)
@pytest.mark.parametrize("point", ["before-commit"])
def test_kill_at_exact_point_fast(tmp_path, point):
    _kill_at(tmp_path, point)


@pytest.mark.faults
@pytest.mark.timeout(600)
@pytest.mark.parametrize("point", sorted(POINTS))
def test_kill_at_exact_point(tmp_path, point):
    _kill_at(tmp_path, point)
