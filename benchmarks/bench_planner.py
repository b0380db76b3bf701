"""Planner at scale, in one process: 64 / 1024 / 4096 simulated ranks x 1000 tensors.

    python benchmarks/bench_planner.py [--ranks 64 1024 4096] [--tensors 1000]

Layouts: FSDP (every tensor row-sharded over all ranks, uneven) and replicated (DDP). Prints
planning time, metadata size, load-planning time for one rank, and the cached re-plan check
(fingerprint of one rank's manifest: what a repeated save does instead of gather + plan).
"""
from __future__ import annotations

import argparse
import hashlib
import pickle
import time

from bytecheckpoint.metadata import Metadata
from bytecheckpoint.planner import TargetSpec, TensorManifest, plan_load, plan_save


def manifests(world: int, tensors: int, layout: str):
    per_rank = [[] for _ in range(world)]
    for t in range(tensors):
        rows, cols = (4096 + 8 * t % 4096), 1024 if t % 3 else 4096
        shape = (rows, cols)
        if layout == "replicated":
            box = ((0, 0), shape)
            for r in range(world):
                per_rank[r].append(TensorManifest(f"layers.{t}.w", "bfloat16", shape, "replicated", (box,)))
            continue
        step = -(-rows // world)
        for r in range(world):
            lo, hi = min(rows, r * step), min(rows, (r + 1) * step)
            boxes = (((lo, 0), (hi - lo, cols)),) if hi > lo else ()
            per_rank[r].append(TensorManifest(f"layers.{t}.w", "bfloat16", shape, "sharded", boxes))
    return [tuple(m) for m in per_rank]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 1024, 4096])
    ap.add_argument("--tensors", type=int, default=1000)
    args = ap.parse_args(argv)
    print(f"| layout | ranks | tensors | plan_save (s) | metadata (MiB) | plan_load, 1 rank (s) | cached check (s) |")
    print("|---|---|---|---|---|---|---|")
    for layout in ("fsdp", "replicated"):
        for world in args.ranks:
            ms = manifests(world, args.tensors, layout)
            t0 = time.perf_counter()
            plan = plan_save(ms)
            t_plan = time.perf_counter() - t0
            md = Metadata(1, "bench", world, plan.tensors, plan.arrays, (), None, {})
            size = len(md.to_json()) / 2**20
            targets = [TargetSpec(m.key, m.dtype, m.shape, m.boxes) for m in ms[world // 2]]
            t0 = time.perf_counter()
            plan_load(plan.tensors, targets)
            t_load = time.perf_counter() - t0
            t0 = time.perf_counter()
            hashlib.sha1(pickle.dumps((world, ms[0]))).hexdigest()
            t_cache = time.perf_counter() - t0
            print(f"| {layout} | {world} | {args.tensors} | {t_plan:.2f} | {size:.1f} | {t_load:.3f} | {t_cache:.4f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
