"""The local tier against persistent checkpoints: stall, background time, recovery after a lost
node, and training steps lost per failure at an equal stall budget.

    python benchmarks/bench_local_tier.py [--mib 128] [--saves 4] [--step-s 1.0] [--budget 0.02]

2 gloo ranks on 2 simulated nodes (node = rank), each holding `--mib` MiB of row-sharded state.
Tiers compared, each with async saves: local tier in /dev/shm with replicas=1 (each rank's part
also copied to the other node), persistent to an S3 server (SeaweedFS on loopback), persistent
to local disk.
- stall: time inside save() (median of saves 2..n); background: save() to committed.
- recovery after losing node 1: a fresh process on node 0 (world 1) from start to its first
  training step done: import, process group, model, restore (local: its own part + node 1's
  replica; persistent: read from S3).
- steps lost per failure at a stall budget b (fraction of step time T): a tier can save every
  k = max(ceil(stall / (b T)), ceil(background / T)) steps (no more often than its background
  write completes), so a failure loses k/2 steps on average plus the save in flight (1 step).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "integration")]
from figures import figure  # noqa: E402  (benchmarks/figures.py: the FIGURE lines run_all.py collects)


# ---------------------------------------------------------------------- rank programs
def _state(mib: int, rank: int, world: int):
    """`mib` MiB per rank of the 2-rank run (the global shapes stay when a restart has 1 rank)."""
    import torch

    import bytecheckpoint as bcp
    cols, n = 1024, 8
    rows = max(2, mib * (1 << 20) // 4 // cols // n * 2)
    step = rows // world
    g = torch.Generator().manual_seed(rank)
    return {f"layer{i}": bcp.Shard(torch.randn(step, cols, generator=g), (rows, cols), (rank * step, 0))
            for i in range(n)}


def _checkpointer(local_dir: str, opts):
    import bytecheckpoint as bcp
    tier = bcp.LocalTier(dir=os.path.join(local_dir, "node{node}"), replicas=1, keep=2, node=lambda r: r)
    return bcp.Checkpointer(local_tier=tier, storage_options=opts)


def saves(tier: str, target: str, local_dir: str, mib: int, n: int, step_s: float, out: str, opts=None) -> None:
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    state = {"model": _state(mib, rank, world), "step": 0}
    ckpt = _checkpointer(local_dir, opts)
    stalls, background = [], []
    for i in range(1, n + 1):
        time.sleep(step_s)                       # the training step
        for t in state["model"].values():
            t.local.add_(1)
        state["step"] = i
        t0 = time.perf_counter()
        if tier == "local":
            h = ckpt.save(f"step_{i}", state, tier="local", async_save=True)
        else:
            h = ckpt.save(f"{target}/step_{i}", state, async_save=True)
        stalls.append(time.perf_counter() - t0)
        h.wait()
        background.append(time.perf_counter() - t0)
    ckpt.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"stall": stalls, "background": background}, f)


def recover(tier: str, target: str, local_dir: str, mib: int, started: float, out: str, opts=None) -> None:
    """A restart on node 0 alone after node 1 was lost: time to the first training step."""
    import bytecheckpoint as bcp
    state = {"model": _state(mib, 0, 1), "step": 0}
    ckpt = _checkpointer(local_dir, opts) if tier == "local" else bcp.Checkpointer(storage_options=opts)
    restored = ckpt.restore(state, persistent=None if tier == "local" else target)
    for t in state["model"].values():            # the first training step
        t.local.add_(1)
    took = time.time() - started
    assert restored.source == ("local" if tier == "local" else "persistent"), restored
    ckpt.close()
    with open(out, "w") as f:
        json.dump({"recovery": took, "restored": restored.name}, f)


# ---------------------------------------------------------------------- driver
def _run(target: str, world: int, args: dict, env=None) -> None:
    from launcher import run_ranks
    run_ranks(f"bench_local_tier:{target}", world, args, timeout=900,
              extra_env={"PYTHONPATH": HERE, **(env or {})})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=128, help="MiB of state per rank")
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--step-s", type=float, default=1.0, help="simulated training step time T")
    ap.add_argument("--budget", type=float, default=0.02, help="stall budget b, fraction of training time")
    ap.add_argument("--quick", action="store_true", help="32 MiB per rank, 3 saves")
    args = ap.parse_args(argv)
    if args.quick:
        args.mib, args.saves = min(args.mib, 32), min(args.saves, 3)
    from seaweed import SeaweedS3
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    rows = {}
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=shm) as local, SeaweedS3() as s3:
        s3.create_bucket("bench")
        opts = s3.storage_options
        targets = {"local": ("local", ""), "persistent, S3 (SeaweedFS)": ("persistent", "s3://bench/run"),
                   "persistent, local disk": ("persistent", os.path.join(tmp, "run"))}
        for label, (tier, target) in targets.items():
            out = os.path.join(tmp, "out.json")
            _run("saves", 2, {"tier": tier, "target": target, "local_dir": local, "mib": args.mib, "n": args.saves,
                              "step_s": args.step_s, "out": out, "opts": opts if target.startswith("s3") else None})
            with open(out) as f:
                r = json.load(f)
            rows[label] = {"stall": statistics.median(r["stall"][1:]), "background": statistics.median(r["background"][1:])}
        shutil.rmtree(os.path.join(local, "node1"))  # node 1 and its local disk are lost
        for label, tier, target in (("local", "local", ""), ("persistent, S3 (SeaweedFS)", "persistent", "s3://bench/run")):
            out = os.path.join(tmp, "rec.json")
            _run("recover", 1, {"tier": tier, "target": target, "local_dir": local, "mib": args.mib,
                                "started": time.time(), "out": out, "opts": opts if tier != "local" else None})
            with open(out) as f:
                rows[label].update(json.load(f))
    T, b = args.step_s, args.budget
    print(f"State: {args.mib} MiB per rank, 2 ranks on 2 simulated nodes; step time T = {T} s; budget b = {b:.0%}.\n")
    print("| tier | stall per save (s) | save to committed (s) | save every k steps | steps lost per failure "
          "(k/2 + 1) | recovery on node 0 alone: start to first step (s) |")
    print("|---|---|---|---|---|---|")
    for label, r in rows.items():
        k = max(1, math.ceil(r["stall"] / (b * T)), math.ceil(r["background"] / T))
        rec = f"{r['recovery']:.2f}" if "recovery" in r else "—"
        print(f"| {label} | {r['stall']:.3f} | {r['background']:.2f} | {k} | {k / 2 + 1:.1f} | {rec} |", flush=True)
    local, s3 = rows["local"], rows["persistent, S3 (SeaweedFS)"]
    what = f"local tier ({args.mib} MiB per rank, 2 ranks)"
    peer = "the persistent tier on S3 (SeaweedFS), same run"
    figure(f"{what}: stall per save", local["stall"], s3["stall"], peer_name=peer)
    figure(f"{what}: save to committed", local["background"], s3["background"], peer_name=peer)
    if "recovery" in local and "recovery" in s3:
        figure(f"{what}: recovery after losing a node, start to first step", local["recovery"], s3["recovery"],
               peer_name=peer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
