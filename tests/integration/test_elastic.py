"""Elastic scale-down and scale-up under torchrun's elastic agent, as users run it.

Two agents on this machine are two "nodes" (`torchrun --nnodes=1:2 --nproc-per-node=1
--rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:<free port> --max-restarts=3`, the rendezvous
settings of docs/elastic.md with one more second of heartbeat slack: elastic_harness.TOLERANT_RDZV).
One training script per API (core, Accelerate, Lightning) resumes by itself from the newest
committed checkpoint on whatever world it is started on. Each test runs one job through three membership changes:

1. 2 -> 1, mid async save: the node of rank 0 is SIGKILLed (agent and workers) while its save of
   step 3 is in flight (its writes are slowed) and after step 2 committed. The survivor's agent
   restarts it on a world of 1; it must resume from step 2 exactly (step 3 is torn).
2. 1 -> 2: a third agent joins while the survivor waits before step 6 (steps <= 5 committed); both
   restart on a world of 2 and resume from step 5.
3. 2 -> 1, mid-run: both wait before step 9 (steps <= 8 committed); the node of rank 1 is
   SIGKILLed and the survivor resumes from step 8 on a world of 1, then finishes step 12.

Every resume is bit-exact against the state recorded when that step was saved, every step saved
more than once (before and after a change) saved the same bytes, and the final state equals an
uninterrupted run on one process (plain torch: the training is the same at every world size and
in every framework, see elastic_common.py). A worker that fails other than by losing its peer fails the test at
once; every wait is bounded and everything is killed by process group at the end.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

import bytecheckpoint as bcp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "elastic_scripts"))
from elastic_common import reference_digest  # noqa: E402
from elastic_harness import TOLERANT_RDZV, Cluster, after, of  # noqa: E402

pytestmark = pytest.mark.timeout(420)
STEPS = 12
WAIT_S = 120


def committed(path: str) -> bool:
    return bcp.is_checkpoint(path)


def saved_path(events: List[Dict[str, Any]], step: int) -> str:
    return of(events, "saving", step=step)[0]["path"]


def wait_committed(c: Cluster, step: int) -> None:
    c.wait_for(f"step {step} committed",
               lambda evs: of(evs, "saving", step=step) and committed(saved_path(evs, step)), WAIT_S)


def scenario(tmp_path: Path, script: str) -> Dict[str, Any]:
    env = {"ELASTIC_STEPS": str(STEPS), "ELASTIC_SLOW": "3:0", "ELASTIC_START_WORLD": "2",
           "ELASTIC_GATES": "6:1:grow,9:2:shrink"}
    out: Dict[str, Any] = {}
    with Cluster(str(tmp_path / "job"), script, env=env, rdzv=TOLERANT_RDZV) as c:
        # 1. two nodes; the node of rank 0 is lost while its save of step 3 is in flight
        c.start("a")
        c.start("b")
        slow = c.wait_for("rank 0 saving step 3 (slowed)", lambda evs: of(evs, "saving", step=3, world=2, rank=0),
                          WAIT_S)[0]
        wait_committed(c, 2)
        assert not committed(slow["path"]), "the slowed save of step 3 committed before the kill"
        t_kill = c.kill(slow["node"])
        first = c.wait_for("the first step on a world of 1", lambda evs: of(after(evs, t_kill), "step", world=1),
                           WAIT_S)[0]
        resumed = of(after(c.events(), t_kill), "resumed", world=1)
        assert len(resumed) == 1 and resumed[0]["step"] == 2, resumed
        out["scale_down_mid_save"] = {"recovery_s": first["t"] - t_kill, "load_s": resumed[0]["load_s"]}

        # 2. a node joins while the survivor waits before step 6
        c.wait_for("the survivor at the gate before step 6", lambda evs: of(after(evs, t_kill), "gate", name="grow"),
                   WAIT_S)
        wait_committed(c, 5)
        c.start("c")
        t_join = time.time()
        gated = c.wait_for("both ranks of the new world before step 9",
                           lambda evs: (lambda g: g if len(g) == 2 else None)(
                               of(after(evs, t_join), "gate", name="shrink", world=2)), WAIT_S)
        c.open_gate("grow")
        grown = [e for e in of(after(c.events(), t_join), "resumed", world=2)]
        assert sorted(e["rank"] for e in grown) == [0, 1] and {e["step"] for e in grown} == {5}, grown
        out["scale_up"] = {"first_step_s": min(e["t"] for e in of(after(c.events(), t_join), "step", world=2))
                           - t_join}

        # 3. the node of rank 1 is lost between steps; the survivor finishes on a world of 1
        wait_committed(c, 8)
        victim = next(e["node"] for e in gated if e["rank"] == 1)
        t_kill2 = c.kill(victim)
        c.open_gate("shrink")
        first2 = c.wait_for("the first step on a world of 1 again",
                            lambda evs: of(after(evs, t_kill2), "step", world=1), WAIT_S)[0]
        resumed2 = of(after(c.events(), t_kill2), "resumed", world=1)
        assert len(resumed2) == 1 and resumed2[0]["step"] == 8, resumed2
        out["scale_down_mid_run"] = {"recovery_s": first2["t"] - t_kill2, "load_s": resumed2[0]["load_s"]}
        survivor = next(n for n in c.agents if n not in c.killed)
        c.wait_exit(survivor, WAIT_S)
        events = c.events()

    # bit-exact: each resume loaded what was saved at that step; a step saved again (after a
    # change) saved the same bytes; the end equals an uninterrupted run
    saves: Dict[int, set] = {}
    for e in of(events, "saving"):
        saves.setdefault(e["step"], set()).add(e["digest"])
    assert all(len(d) == 1 for d in saves.values()), {s: d for s, d in saves.items() if len(d) > 1}
    for e in of(events, "resumed"):
        assert {e["digest"]} == saves[e["step"]], f"resumed step {e['step']} differs from its save: {e}"
    done = of(events, "done")
    assert len(done) == 1 and done[0]["step"] == STEPS and done[0]["world"] == 1, done
    out["final_digest"] = done[0]["digest"]
    print(json.dumps({k: v for k, v in out.items() if k != "final_digest"}))
    return out


# Accelerate's and Lightning's scripts: `make test-slow` (the examples' stories in make test run both
# frameworks through a lost node under torchrun; core_train.py here takes all three membership changes)
@pytest.mark.parametrize("script", ["core_train.py", pytest.param("accelerate_train.py", marks=pytest.mark.slow),
                                    pytest.param("lightning_train.py", marks=pytest.mark.slow)])
def test_elastic_scale_down_and_up(tmp_path: Path, script: str) -> None:
    if script.startswith("lightning"):
        pytest.importorskip("lightning")
    if script.startswith("accelerate"):
        pytest.importorskip("accelerate")
    out = scenario(tmp_path, script)
    assert out["final_digest"] == reference_digest(STEPS), "the elastic run ended elsewhere than an uninterrupted one"
