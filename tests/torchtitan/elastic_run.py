"""One elastic torchtitan job that loses a node (test_torchtitan_elastic.py and
examples/torchtitan_elastic.py drive it; the worker is titan_elastic.py).

Two torchrun elastic agents on this machine are two "nodes" (`torchrun --nnodes=1:2 --nproc-per-node=1`,
c10d rendezvous on loopback: elastic_harness.Cluster), each running torchtitan's real Trainer with
ByteCheckpointManager (async saves every 2 steps, FSDP 2, global batch 4 from local batches of 2). Both
ranks wait before step `kill_before` once step `kill_before - 1` is committed; the node of rank 0 is
SIGKILLed (agent and worker, no teardown) and the gate opened: the survivor's next collective fails,
its agent restarts it on a world of 1, and torchtitan resumes through the manager at DP 1 (2 gradient-
accumulation micro-batches per step). Beside it, the same training uninterrupted on 2 processes.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration", "elastic_scripts"))

import launch  # noqa: E402
from elastic_harness import TOLERANT_RDZV, Cluster, after, of  # noqa: E402

WAIT_S = 300


def spec(data: str, dump: str, steps: int) -> Dict[str, Any]:
    return dict(steps=steps, data_dir=os.fspath(data), dump=os.fspath(dump), manager="bcp", interval=2,
                async_mode="async", local_batch=2, global_batch=4)


def lose_a_node(workdir, steps: int = 6, kill_before: int = 5) -> Dict[str, Any]:
    """Returns the uninterrupted run's records (`full`, launch.run's), the elastic job's events, the
    kill's time and the first step on one process."""
    import bytecheckpoint as bcp

    workdir = os.fspath(workdir)
    data = launch.make_dataset(os.path.join(workdir, "data"))
    full = launch.run(2, spec(data, os.path.join(workdir, "full"), steps), timeout=WAIT_S)

    job = os.path.join(workdir, "job")
    run = os.path.join(job, "run")
    cache = os.path.join(run, "hf_cache")
    env = dict(TITAN_SPEC=json.dumps(spec(data, run, steps)), ELASTIC_START_WORLD="2", ELASTIC_STEPS=str(steps),
               ELASTIC_GATES=f"{kill_before}:2:lose", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_DATASETS_CACHE=cache, HF_HOME=os.path.join(cache, "home"), WANDB_MODE="disabled",
               TORCHINDUCTOR_CACHE_DIR=cache)
    committed = os.path.join(run, "checkpoint", f"step-{kill_before - 1}")
    with Cluster(job, os.path.join(HERE, "titan_elastic.py"), env=env, rdzv=TOLERANT_RDZV) as c:
        c.start("a")
        c.start("b")
        at_gate = c.wait_for(f"both ranks before step {kill_before}",
                             lambda evs: len(of(evs, "gate", step=kill_before, world=2)) == 2 and evs, WAIT_S)
        c.wait_for(f"step {kill_before - 1} committed", lambda evs: bcp.is_checkpoint(committed), WAIT_S)
        lost = of(at_gate, "gate", rank=0)[0]["node"]
        t_kill = c.kill(lost)
        c.open_gate("lose")
        first = c.wait_for("the first step on a world of 1",
                           lambda evs: of(after(evs, t_kill), "step", world=1), WAIT_S)[0]
        c.wait_exit("b" if lost == "a" else "a", WAIT_S)
        events = c.events()
    return {"full": full, "events": events, "t_kill": t_kill, "first": first,
            "node_lost_to_first_step_s": first["t"] - t_kill}
