"""kill -9 during saves of the pipeline, expert and torchtitan layouts (make test-faults).

Layouts of tests/scenarios_pipeline.py on gloo ranks: PP2 x FSDP2 (4 ranks, 1F1B, AdamW, LR scheduler,
data loader) and grouped experts sharded over EP 2 (2 ranks). Each trial: a job resumes from the
committed step 1, trains step 2 and saves it (sync or async); from the moment every rank is about to
save, one rank (or every rank) is SIGKILLed at a random moment within the save's measured time (the
async commit included). Then:
- survivors exit with an error by themselves (no rank waits forever on a dead peer);
- step 2 is either committed (loads and verifies) or never loadable: inspect says incomplete, verify
  fails, a load raises IncompleteCheckpointError (or nothing was written);
- the next launch at the same layout resumes from the newest committed step (`bcp.latest`) and its
  model and optimizer state equal, bit for bit, the state of an uninterrupted run that saved only
  that step.
torchtitan's real Trainer (FSDP2, 2 processes, async saves every 2 steps): one rank killed while the
manager's save of step 4 is in flight; the next launch resumes from the newest committed step and
every later step's loss equals the uninterrupted run's exactly.

Trials per layout and mode: BCP_LAYOUT_KILL_TRIALS (default 3); outcomes reported as JSON lines like
test_kill.py's (BCP_FAULT_REPORT).
"""
from __future__ import annotations

import collections
import json
import os
import random
import shutil
import sys
import time

import pytest
import torch

import bytecheckpoint as bcp

from harness import Job, kill_when_ready, run
from test_kill import SEED, SURVIVOR_EXIT_S, _report, _save_seconds

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
from scenarios_pipeline import merged_outputs  # noqa: E402

TRIALS = int(os.environ.get("BCP_LAYOUT_KILL_TRIALS", "3"))
LAYOUTS = {  # name: (target, world, args)
    "pp2xfsdp2": ("scenarios_pipeline:train", 4, dict(pp=2, dp=2, splits=[2, 2], schedule="1f1b")),
    "experts-ep2": ("scenarios_pipeline:experts", 2, dict(ep=2, form="grouped")),
}
MODES = [(False, "one"), (True, "one"), (True, "all")]
MODE_IDS = ["sync-one", "async-one", "async-all"]

pytestmark = pytest.mark.faults


def _job_args(layout, out, **more):
    os.makedirs(out, exist_ok=True)
    return dict(LAYOUTS[layout][2], out=str(out), **more)


def _state_equal(got, want, what):
    assert sorted(got["model"]) == sorted(want["model"]) and sorted(got["optim"]) == sorted(want["optim"]), what
    for name, t in want["model"].items():
        assert torch.equal(got["model"][name], t), f"{what}: {name}"
    for name, st in want["optim"].items():
        for k, v in st.items():
            same = torch.equal(got["optim"][name][k], v) if torch.is_tensor(v) else got["optim"][name][k] == v
            assert same, f"{what}: optimizer {name}/{k}"


def _uncommitted_never_loads(path):
    """What a killed save left at `path`: 'empty' (nothing a load recognises: no file, or data files
    without any metadata) or 'incomplete' (refused by load, reported so by inspect and verify)."""
    try:
        bcp.load_full(path)
    except bcp.IncompleteCheckpointError:
        assert not bcp.inspect(path).complete, f"inspect calls the killed save at {path} complete"
        assert not bcp.verify(path).ok, f"verify passes the killed save at {path}"
        return "incomplete"
    except bcp.CheckpointNotFoundError:
        return "empty"
    raise AssertionError(f"the uncommitted save at {path} loaded")


def _references(tmp_path, layout, async_save):
    """The uninterrupted runs: one that saved only step 1 (into base/step_1), one that went on and
    saved step 2; returns their final states and the save's seconds."""
    target, world, _ = LAYOUTS[layout]
    base = tmp_path / "base"
    run(target, world, _job_args(layout, tmp_path / "ref1", stop=1, saves={1: str(base / "step_1")}), timeout=180)
    outs = run(target, world, _job_args(layout, tmp_path / "ref2", load=str(base / "step_1"), stop=2,
                                        saves={2: str(base / "step_2")}, async_save=async_save), timeout=180)
    return {1: merged_outputs(str(tmp_path / "ref1")), 2: merged_outputs(str(tmp_path / "ref2"))}, _save_seconds(outs)


def _killed_job(tmp_path, layout, i, async_save, marker_dir=None, env=None):
    """Trial i: resume from a copy of the committed step 1, train step 2 and save it into trial<i>/."""
    target, world, _ = LAYOUTS[layout]
    root = tmp_path / f"trial{i}"
    shutil.copytree(tmp_path / "base" / "step_1", root / "step_1")
    return root, Job(target, world, _job_args(layout, tmp_path / f"killed{i}", load=str(root / "step_1"), stop=2,
                                               saves={2: str(root / "step_2")}, async_save=async_save,
                                               marker_dir=marker_dir), env=env)


def _judge_and_resume(tmp_path, layout, i, root, want) -> str:
    """What the kill left at step 2 (committed: loads and verifies; else never loadable), then the next
    launch resumes from the newest committed step, equal to the run that saved only it."""
    target, world, _ = LAYOUTS[layout]
    step2 = str(root / "step_2")
    kind = "complete" if bcp.is_checkpoint(step2) else _uncommitted_never_loads(step2)
    if kind == "complete":
        assert bcp.verify(step2).ok, f"trial {i}: a committed step 2 fails verify"
    latest = bcp.latest(str(root))
    step = 2 if kind == "complete" else 1
    assert latest is not None and os.path.basename(latest) == f"step_{step}", (kind, latest)
    run(target, world, _job_args(layout, tmp_path / f"resumed{i}", load=latest, stop=step), timeout=180)
    _state_equal(merged_outputs(str(tmp_path / f"resumed{i}")), want[step], f"trial {i}: resumed from step {step} ({kind})")
    return kind


@pytest.mark.timeout(3000)
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_kill_during_a_layouts_save(tmp_path, layout, mode):
    async_save, victims = mode
    rng = random.Random(f"{SEED}-{layout}-{mode}")
    want, save_s = _references(tmp_path, layout, async_save)
    window = max(0.05, 1.3 * save_s)
    outcomes = collections.Counter()
    survivors_errored = survivor_checks = 0
    for i in range(TRIALS):
        markers = tmp_path / f"markers{i}"
        markers.mkdir()
        root, job = _killed_job(tmp_path, layout, i, async_save, str(markers))
        checked, errored = kill_when_ready(job, str(markers), rng, window, victims, SURVIVOR_EXIT_S, i)
        survivor_checks += checked
        survivors_errored += errored
        outcomes[_judge_and_resume(tmp_path, layout, i, root, want)] += 1
    _report(f"kill_{layout}", {"mode": "-".join(["async" if async_save else "sync", victims]), "trials": TRIALS,
                               "outcomes": dict(sorted(outcomes.items())), "survivor_checks": survivor_checks,
                               "survivors_exited_with_error": survivors_errored, "kill_window_s": round(window, 3)})
    assert sum(outcomes.values()) == TRIALS


# SIGKILL from inside the storage layer at chosen requests of step 2's save (BCP_FAULTS kind "kill"):
# the moments random kills rarely hit, every time
POINTS = {
    "mid-data": ({"op": "write", "kind": "kill", "key": "/pack/", "rank": 1}, False),
    "before-commit": ({"op": "write", "kind": "kill", "key": "metadata.json", "rank": 0}, False),
    "async-before-commit": ({"op": "write", "kind": "kill", "key": "metadata.json", "rank": 0}, True),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("point", sorted(POINTS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_kill_at_an_exact_point_of_a_layouts_save(tmp_path, layout, point):
    rule, async_save = POINTS[point]
    want, _ = _references(tmp_path, layout, async_save)
    root, job = _killed_job(tmp_path, layout, 0, async_save, env={"BCP_FAULTS": json.dumps([rule])})
    codes = job.finish(120)
    assert codes[rule["rank"]] == -9, f"{point}: rank {rule['rank']} was not killed there:\n{job.describe()}"
    assert all(c not in (0, None) for c in codes), f"{point}: a survivor did not fail:\n{job.describe()}"
    kind = _judge_and_resume(tmp_path, layout, 0, root, want)
    assert kind == "incomplete", kind
    _report(f"kill_{layout}_at_{point}", {"trials": 1, "outcomes": {kind: 1}})


# ---------------------------------------------------------------------- torchtitan's Trainer
TITAN = os.path.join(TESTS, "torchtitan")


def _titan_env(dump):
    cache = os.path.join(dump, "hf_cache")
    root = os.path.dirname(TESTS)
    return dict(PYTHONPATH=os.pathsep.join((root, TITAN, TESTS, os.path.dirname(os.path.abspath(__file__)))),
                HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=cache,
                HF_HOME=os.path.join(cache, "home"), WANDB_MODE="disabled", TORCHINDUCTOR_CACHE_DIR=cache,
                LOCAL_WORLD_SIZE="2")


@pytest.mark.timeout(1800)
def test_kill_during_torchtitans_save(tmp_path):
    pytest.importorskip("torchtitan", reason="pip install 'bytecheckpoint[torchtitan]'")
    sys.path.insert(0, TITAN)
    import launch

    data = launch.make_dataset(tmp_path / "data")

    def spec(dump):
        return dict(steps=6, data_dir=str(data), dump=str(dump), manager="bcp", interval=2, async_mode="async",
                    out=os.path.join(dump, "record"))

    full = launch.run(2, spec(tmp_path / "full"), timeout=300)
    rng = random.Random(f"{SEED}-torchtitan")
    outcomes = collections.Counter()
    for i in range(max(2, TRIALS // 2)):
        dump = tmp_path / f"trial{i}"
        os.makedirs(dump)
        job = Job("titan_rank:main", 2, {"spec": spec(dump)}, env=_titan_env(str(dump)))
        saving = dump / "checkpoint" / "step-4"
        try:
            deadline = time.monotonic() + 240
            while not saving.exists():
                assert time.monotonic() < deadline and all(p.poll() is None for p in job.procs), \
                    f"trial {i}: step 4's save never started:\n{job.describe()}"
                time.sleep(0.002)
            time.sleep(rng.uniform(0, 0.3))
            job.kill([rng.randrange(2)])
            codes = job.wait(SURVIVOR_EXIT_S)
            assert all(c is not None for c in codes), f"trial {i}: a survivor hung:\n{job.describe()}"
        finally:
            job.finish(5)
        kind = "complete" if bcp.is_checkpoint(str(saving)) else _uncommitted_never_loads(str(saving))
        later = [s for s in (6,) if bcp.is_checkpoint(str(dump / "checkpoint" / f"step-{s}"))]
        assert not later, f"trial {i}: the kill came after step 6 committed"
        resumed = launch.run(2, spec(dump), timeout=300)
        start = 4 if kind == "complete" else 2
        assert sorted(resumed[0]["losses"]) == list(range(start + 1, 7)), (kind, resumed[0]["losses"])
        for step, loss in resumed[0]["losses"].items():
            assert loss == full[0]["losses"][step], f"trial {i}: step {step} after resuming from step {start}"
        outcomes[kind] += 1
    _report("kill_torchtitan", {"mode": "async-one", "trials": sum(outcomes.values()),
                                "outcomes": dict(sorted(outcomes.items()))})
