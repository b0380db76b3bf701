"""Two independent jobs save to the same path at the same moment (overwrite=False): exactly one
wins; every rank of the other gets CheckpointExistsError; the path holds the winner's state,
whole, and verifies. Data writes are slowed so that both jobs are past their "path is free"
check before either commits: the conditional commit (write metadata.json only if absent) is
what decides, on the file system and on S3 (If-None-Match)."""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

import bytecheckpoint as bcp

import fault_scenarios as fs
from harness import Job

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integration"))
from seaweed import seaweed  # noqa: E402,F401 - fixture

SLOW = json.dumps([{"op": "write", "kind": "slow", "delay_s": 0.25, "key": "/pack/", "count": 8}])


def race(path, world, tmp_path, storage_options=None):
    markers = tmp_path / f"m{time.monotonic_ns()}"
    markers.mkdir()
    jobs = [Job("fault_scenarios:racing_job", world,
                {"path": path, "version": v, "marker_dir": str(markers), "ranks_total": 2 * world,
                 "storage_options": storage_options}, env={"BCP_FAULTS": SLOW}) for v in (1, 2)]
    codes = [j.finish(120) for j in jobs]
    outs = [j.outputs() for j in jobs]
    assert codes == [[0] * world, [0] * world], "\n".join(j.describe() for j in jobs)
    results = {}
    for v, job_outs in zip((1, 2), outs):
        kinds = {("WON" if f"JOB {v} WON" in o else "LOST" if f"JOB {v} LOST" in o else "?") for o in job_outs}
        assert len(kinds) == 1 and "?" not in kinds, f"job {v}: ranks disagree: {job_outs}"
        results[v] = kinds.pop()
    assert sorted(results.values()) == ["LOST", "WON"], results
    winner = next(v for v, r in results.items() if r == "WON")
    loser_out = outs[2 - winner if winner == 1 else 0][0]
    assert "another job committed" in loser_out or "already holds a checkpoint" in loser_out, loser_out
    fs.load_and_check(path, winner, storage_options=storage_options)
    assert bcp.verify(path, storage_options=storage_options).ok
    return winner


@pytest.mark.timeout(200)
def test_two_jobs_one_path(tmp_path):
    race(str(tmp_path / "shared"), 1, tmp_path)


@pytest.mark.faults
@pytest.mark.timeout(900)
@pytest.mark.parametrize("round_", range(4))
def test_two_jobs_one_path_2_ranks_each(tmp_path, round_):
    race(str(tmp_path / "shared"), 2, tmp_path)


@pytest.mark.faults
@pytest.mark.timeout(900)
@pytest.mark.parametrize("round_", range(3))
def test_two_jobs_one_path_on_s3(seaweed, tmp_path, round_):
    bucket = f"race-{os.getpid()}-{round_}"
    seaweed.create_bucket(bucket)
    race(f"s3://{bucket}/shared", 2, tmp_path, seaweed.storage_options)


@pytest.mark.timeout(200)
def test_losing_job_leaves_no_data_behind(tmp_path):
    path = str(tmp_path / "shared")
    race(path, 1, tmp_path)
    data_dirs = [d for d in os.listdir(path) if d.startswith("data-")]
    assert len(data_dirs) == 1, data_dirs
