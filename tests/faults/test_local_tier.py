"""The local tier as a failure: 4 gloo ranks simulate 2 nodes x 2 ranks, each node with its own
local directory; a local checkpoint every step, replicas=1. Node 1's processes are killed (-9)
and its local directory deleted at a random step; node 0's 2 ranks restart and resume from the
newest step they hold completely, bit-exact, without reading a byte of persistent tensor data.
With replicas=0 the survivors cannot hold every part: they fall back to the persistent tier and
say so. The same story runs under Accelerate (2 processes as 2 nodes, attachment.save_local /
restore; one process resumes); the Lightning one is tests/integration/test_lightning_local_tier.py."""
import json
import os
import random
import shutil
import time

import pytest

import bytecheckpoint as bcp
from harness import Job, run

SEED = int(os.environ.get("BCP_LOCAL_TIER_SEED", str(int(time.time()) % 10000)))
STEPS = 8


def _wait_step(job: Job, run_dir: str, step: int, world: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(run_dir, "markers", f"step_{step}.{r}")) for r in range(world)):
            return
        if any(p.poll() not in (None, 0) for p in job.procs):
            raise AssertionError(f"a rank failed before step {step}:\n{job.describe()}")
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in {timeout}s:\n{job.describe()}")


def _newest_committed(node_dir: str):
    root = os.path.join(node_dir, "bcp-local", "default")
    best = None
    for name in os.listdir(root) if os.path.isdir(root) else []:
        meta = os.path.join(root, name, "local-metadata.json")
        if os.path.isfile(meta):
            with open(meta) as f:
                created = json.load(f)["info"]["created_unix"]
            best = max(best or (0, ""), (created, name))
    return best[1] if best else None


def _wait_persistent(job: Job, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not bcp.is_checkpoint(path):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in job.procs):
            raise AssertionError(f"persistent checkpoint {path} not committed in {timeout}s:\n{job.describe()}")
        time.sleep(0.05)


def _lose_node_1(tmp_path, replicas: int, program: str = "local_tier_scenarios", world: int = 4,
                 persistent: str = os.path.join("persistent", "step_3"), first_kill: int = 3):
    """Train `world` ranks as 2 nodes; kill node 1's ranks (-9) at a random step and delete its
    local directory. The persistent save of step 3 is asynchronous: the fallback story needs it
    committed before the node is lost (otherwise there is honestly nothing to fall back to)."""
    kill_at = random.Random(SEED + replicas + (0 if world == 4 else 10)).randint(first_kill, STEPS - 2)
    run_dir = str(tmp_path / "run")
    job = Job(f"{program}:train", world, {"run": run_dir, "steps": STEPS, "replicas": replicas, "persist_every": 3})
    try:
        _wait_step(job, run_dir, kill_at, world, timeout=150)
        _wait_persistent(job, os.path.join(run_dir, persistent), timeout=60)
        job.kill(list(range(world // 2, world)))
        shutil.rmtree(os.path.join(run_dir, "local", "node1"))   # node 1's disk is gone too
    finally:
        job.finish(60)   # node 0's ranks fail on their next collective with the dead peers
    return run_dir, kill_at


def _lose_node_1_under_accelerate(tmp_path, replicas: int):
    return _lose_node_1(tmp_path, replicas, "accelerate_local_tier_scenarios", world=2,
                        persistent=os.path.join("checkpoints", "checkpoint_0", "bytecheckpoint"), first_kill=4)


def _resume_locally(run_dir: str, program: str, world: int) -> dict:
    """Resume with every chunk read of the persistent tier failing: no persistent tensor byte may
    be read. Returns the RESTORED line, checked against node 0's newest commit."""
    expected = _newest_committed(os.path.join(run_dir, "local", "node0"))
    assert expected is not None, f"no local checkpoint committed (seed {SEED})"
    faults = {"BCP_FAULTS": json.dumps([{"op": "read", "kind": "error", "key": "/pack/"}])}
    outs = run(f"{program}:resume", world, {"run": run_dir, "replicas": 1}, timeout=150, env=faults)
    got = _restored(outs)
    assert got["source"] == "local" and got["name"] == expected, (got, expected, SEED)
    assert all("TRAINED ON" in o for o in outs)
    return got


def _restored(outs):
    lines = [json.loads(o.split("RESTORED ", 1)[1].splitlines()[0]) for o in outs]
    same = [{k: v for k, v in line.items() if k != "seconds"} for line in lines]
    assert all(line == same[0] for line in same), lines
    return lines[0]


@pytest.mark.timeout(400)
def test_lost_node_resumes_from_local_replicas_on_fewer_ranks(tmp_path):
    run_dir, kill_at = _lose_node_1(tmp_path, replicas=1)
    got = _resume_locally(run_dir, "local_tier_scenarios", 2)
    assert int(got["name"].split("_")[1]) >= kill_at - 1, (got, kill_at)


@pytest.mark.timeout(400)
def test_without_replicas_the_survivors_fall_back_to_the_persistent_tier(tmp_path):
    run_dir, kill_at = _lose_node_1(tmp_path, replicas=0)
    outs = run("local_tier_scenarios:resume", 2, {"run": run_dir, "replicas": 0}, timeout=150)
    got = _restored(outs)
    newest = bcp.default_checkpointer()
    persistent = os.path.join(run_dir, "persistent")
    want = max((newest.metadata(os.path.join(persistent, n)).info["created_unix"], n)
               for n in os.listdir(persistent) if bcp.is_checkpoint(os.path.join(persistent, n)))[1]
    assert got["source"] == "persistent" and got["name"].endswith(want), (got, want, SEED)
    assert "no local checkpoint is held completely by these 2 ranks" in got["reason"], got


@pytest.mark.timeout(200)
def test_restore_moves_parts_between_ranks_that_hold_them(tmp_path):
    outs = run("local_tier_scenarios:save_then_restore_swapped", 2, {"run": str(tmp_path / "run")}, timeout=150)
    assert all("SWAPPED OK" in o for o in outs)


# ------------------------------------------------------------------ the same story under Accelerate

@pytest.mark.timeout(400)
def test_accelerate_lost_node_resumes_from_the_local_tier_on_one_process(tmp_path):
    run_dir, _ = _lose_node_1_under_accelerate(tmp_path, replicas=1)
    _resume_locally(run_dir, "accelerate_local_tier_scenarios", 1)


@pytest.mark.timeout(400)
def test_accelerate_without_replicas_falls_back_to_save_state(tmp_path):
    run_dir, kill_at = _lose_node_1_under_accelerate(tmp_path, replicas=0)
    outs = run("accelerate_local_tier_scenarios:resume", 1, {"run": run_dir, "replicas": 0}, timeout=150)
    got = _restored(outs)
    assert got["source"] == "persistent" and got["step"] % 3 == 0 and got["step"] <= kill_at, (got, kill_at, SEED)
    assert "no local checkpoint is held completely by these 1 ranks" in got["reason"], got


@pytest.mark.timeout(120)
def test_every_survivor_of_a_torn_local_save_names_the_dead_rank_within_dead_peer_s(tmp_path):
    """A rank killed (-9) right after an async local save returned: each of the three survivors'
    wait() raises PeerTimeoutError naming it within dead_peer_s plus a margin (before: two raised
    raw gloo errors at once and the third waited for timeout_s in the tier group's all_gather)."""
    dead_peer_s, victim = 3.0, 3
    job = Job("local_tier_scenarios:torn_save", 4, {"run": str(tmp_path), "victim": victim,
                                                    "dead_peer_s": dead_peer_s})
    codes = job.finish(60)
    outputs = job.outputs()
    assert codes[victim] == -9, job.describe()
    for r in (0, 1, 2):
        line = next((ln for ln in outputs[r].splitlines() if ln.startswith(f"rank {r}: WAITED")), None)
        assert line is not None and codes[r] == 0, job.describe()
        waited = float(line.split()[3])
        assert "PEER_TIMEOUT" in line and f"rank {victim} " in line, line
        assert waited < dead_peer_s + 4.0, line
    assert not os.path.exists(os.path.join(tmp_path, "local", "node0", "bcp-local", "default", "step_1",
                                           "local-metadata.json")), "a torn local save was committed"
