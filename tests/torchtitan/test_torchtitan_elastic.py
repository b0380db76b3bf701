"""torchtitan's real Trainer under torchrun's elastic agent loses a node (elastic_run.lose_a_node: two
"nodes", FSDP 2, async saves every 2 steps, the node of rank 0 SIGKILLed before step 5): the survivor,
restarted by its agent on a world of 1, resumes through ByteCheckpointManager from step 4 at DP 1 with
the global batch kept (2 gradient-accumulation micro-batches instead of 1), trains every later step on
exactly the token rows of the uninterrupted 2-process run (rank 0's then rank 1's) and reaches its
loss. The time from the loss of the node to the first step on one process is printed, as the demo
prints it."""
from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("torchtitan", reason="pip install 'bytecheckpoint[torchtitan]'")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import elastic_run  # noqa: E402
from elastic_harness import after, of  # noqa: E402

pytestmark = [pytest.mark.torchtitan, pytest.mark.timeout(900)]
STEPS, KILL_BEFORE = 6, 5


def test_a_lost_node_resumes_at_dp1_on_the_uninterrupted_runs_samples(tmp_path):
    out = elastic_run.lose_a_node(tmp_path, steps=STEPS, kill_before=KILL_BEFORE)
    full, events, t_kill = out["full"], out["events"], out["t_kill"]

    before = {e["step"]: e for e in of(events, "step", world=2)}
    resumed = of(after(events, t_kill), "resumed", world=1)
    assert [e["step"] for e in resumed] == [KILL_BEFORE - 1], resumed
    steps = {e["step"]: e for e in of(after(events, t_kill), "step", world=1)}
    assert sorted(steps) == list(range(KILL_BEFORE, STEPS + 1))
    assert of(events, "done", world=1, step=STEPS)
    for step in range(1, KILL_BEFORE):  # before the loss, the elastic job is the uninterrupted run
        assert before[step]["loss"] == full[0]["losses"][step]
        assert before[step]["accumulation"] == 1
    for step, e in steps.items():
        assert e["accumulation"] == 2
        assert e["batches"] == full[0]["batches"][step] + full[1]["batches"][step], f"step {step}'s samples"
        assert e["loss"] == pytest.approx(full[0]["losses"][step], rel=1e-4), f"step {step}'s loss"
    print(f"\nnode lost -> first step on 1 process (torchrun restarts the survivor, torchtitan resumes step "
          f"{KILL_BEFORE - 1}): {out['node_lost_to_first_step_s']:.1f} s")
