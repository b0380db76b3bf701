"""Elastic scale-down under torchrun's elastic agent: from losing a node to the first training
step on the smaller world, with the checkpoint load reported separately (docs/elastic.md).

    python benchmarks/bench_elastic.py [--mib 64] [--repeats 3] [--frameworks core,accelerate,lightning] [--quick]

Two torchrun agents on this machine (`--nnodes=1:2 --nproc-per-node=1`, c10d rendezvous on a
store this process hosts, `--max-restarts=3`) run tests/integration/elastic_scripts/<api>_train.py:
an AdamW MLP whose weights and optimizer state take `--mib` MiB, an async save every step, a resume
from `bcp.latest` / `attachment.latest()` / `ckpt_path=bcp.latest(...)` on every start. Both ranks
wait before step 5 (steps <= 4 committed); the node of rank 1 is SIGKILLed (agent and worker) and
the clock runs until the survivor's first step on a world of 1. The parts: the survivor's worker
fails (its collective breaks), its agent's new rendezvous (the dead node's heartbeat must expire,
then the last call), the new process (interpreter and imports), resume (process group, model,
checkpoint load), the first step.

Compared: the rendezvous settings of docs/elastic.md (keep_alive_interval=1,
keep_alive_max_attempt=3, last_call_timeout=1) against torchrun's defaults (5 s x 3, 30 s), and the
recovery against the 10 s target.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(ROOT, "tests", "integration", "elastic_scripts")]
from figures import figure  # noqa: E402  (benchmarks/figures.py: the FIGURE lines run_all.py collects)
from elastic_harness import FAST_RDZV, Cluster, after, of  # noqa: E402

TARGET_S = 10.0
DEFAULT_RDZV = {"join_timeout": 300}  # torchrun's own keep-alive (5 s x 3) and last call (30 s)
GATE_STEP = 5


def hidden_for(mib: float) -> int:
    """The hidden width whose parameters + AdamW moments take `mib` MiB (elastic_common.model)."""
    return max(64, int(mib * 2**20 / (3 * 4 * 21)))


def one_run(script: str, mib: float, rdzv: Dict[str, Any]) -> Dict[str, float]:
    env = {"ELASTIC_STEPS": str(GATE_STEP + 2), "ELASTIC_START_WORLD": "2", "ELASTIC_HIDDEN": str(hidden_for(mib)),
           "ELASTIC_GATES": f"{GATE_STEP}:2:go"}
    with tempfile.TemporaryDirectory() as d, Cluster(d, script, env=env, rdzv=rdzv) as c:
        c.start("a")
        c.start("b")
        gated = c.wait_for("both ranks at the gate", lambda evs: (lambda g: g if len(g) == 2 else None)(
            of(evs, "gate", name="go", world=2)), 300)
        c.wait_for(f"step {GATE_STEP - 1} committed", lambda evs: any(
            e["step"] == GATE_STEP - 1 and _committed(e["path"]) for e in of(evs, "saving")), 300)
        victim = next(e["node"] for e in gated if e["rank"] == 1)
        t_kill = c.kill(victim)
        c.open_gate("go")
        first = c.wait_for("the first step on a world of 1", lambda evs: of(after(evs, t_kill), "step", world=1),
                           300)[0]
        events = after(c.events(), t_kill)
        failed = of(events, "error")
        start = of(events, "start", world=1)[0]
        resumed = of(events, "resumed", world=1)[0]
        assert resumed["step"] == GATE_STEP - 1, resumed
        survivor = next(n for n in c.agents if n not in c.killed)
        c.wait_exit(survivor, 300)
    return {
        "recovery": first["t"] - t_kill,
        "worker_failed": (failed[0]["t"] - t_kill) if failed else float("nan"),
        "new_process": start["t_start"] - t_kill,
        "imports": start["t"] - start["t_start"],
        "resume": resumed["t"] - start["t"],
        "load": resumed["load_s"],
        "first_step": first["t"] - resumed["t"],
    }


def _committed(path: str) -> bool:
    import bytecheckpoint as bcp
    return bcp.is_checkpoint(path)


def median(runs: List[Dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=64, help="weights + AdamW state, MiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--frameworks", default="core,accelerate,lightning")
    ap.add_argument("--no-defaults", action="store_true", help="skip the torchrun-defaults runs (~50 s each)")
    ap.add_argument("--quick", action="store_true", help="8 MiB, 1 run, core API only, no defaults run")
    args = ap.parse_args(argv)
    if args.quick or os.environ.get("BCP_BENCH_QUICK") == "1":
        args.mib, args.repeats, args.frameworks, args.no_defaults = 8, 1, "core", True
    print(f"elastic 2 -> 1 under torchrun, {args.mib:g} MiB of state, {args.repeats} run(s) per configuration; "
          f"docs settings: {FAST_RDZV}")
    results: Dict[str, List[Dict[str, float]]] = {}
    for name in args.frameworks.split(","):
        configs = [("docs", FAST_RDZV)] + ([] if args.no_defaults or name != "core" else [("defaults", DEFAULT_RDZV)])
        for _ in range(args.repeats):  # interleaved
            for label, rdzv in configs:
                run = one_run(f"{name}_train.py", args.mib, rdzv)
                results.setdefault(f"{name}/{label}", []).append(run)
                print(f"  {name:10s} {label:8s} " + "  ".join(f"{k} {v:.2f}" for k, v in run.items()), flush=True)

    print("\n| API, settings | kill -> first step (s) | worker failed | new process | imports | resume (load) | "
          "first step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for key, runs in results.items():
        print(f"| {key} | {median(runs, 'recovery'):.2f} | {median(runs, 'worker_failed'):.2f} | "
              f"{median(runs, 'new_process'):.2f} | {median(runs, 'imports'):.2f} | {median(runs, 'resume'):.2f} "
              f"({median(runs, 'load'):.3f}) | {median(runs, 'first_step'):.3f} |")
    print(json.dumps({k: {m: median(v, m) for m in v[0]} for k, v in results.items()}))

    size = f"{args.mib:g} MiB"
    for name in args.frameworks.split(","):
        runs = results[f"{name}/docs"]
        rec = median(runs, "recovery")
        figure(f"elastic 2->1 ({name}, {size}): kill to first step on the smaller world", rec, TARGET_S, "<= 1.0",
               peer_name="the 10 s target", note="rendezvous settings of docs/elastic.md")
        figure(f"elastic 2->1 ({name}, {size}): checkpoint load within that recovery", median(runs, "load"), rec,
               peer_name="kill to first step")
    if "core/defaults" in results:
        figure(f"elastic 2->1 (core, {size}): kill to first step, docs settings vs torchrun defaults",
               median(results["core/docs"], "recovery"), median(results["core/defaults"], "recovery"), "<= 0.5",
               peer_name="torchrun defaults (keep-alive 5 s x 3, last call 30 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
