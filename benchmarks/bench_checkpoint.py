"""bytecheckpoint vs DCP (sync + async), raw write+fsync and memcpy, on gloo ranks, in one run.

    python benchmarks/bench_checkpoint.py [--quick] [--mib 768] [--reps 5] [--dir /tmp/bcp-bench]

An LLM-like state (4096-wide fp32 matrices + norms, params and two Adam moments) sharded over
2 gloo ranks (FSDP-style, dim 0). Peers are interleaved inside every repetition; medians. Then
loads of the W=2 checkpoints at W=1 and W=3, of W=4 checkpoints at W=3, and a replicated (DDP)
state at W=2 with zero-redundancy by policy, forced on and forced off. Every load reads cold (the
page cache dropped before it, every peer; BCP_BENCH_WARM_LOADS=1: as found). Prints FIGURE lines
(benchmarks/figures.py) with targets, and writes benchmarks/out/checkpoint.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, HERE)
from bench_real_model import cold_note  # noqa: E402
from figures import figure  # noqa: E402
from launcher import run_ranks  # noqa: E402


def bench_lines(outs):
    for out in outs:
        for line in out.splitlines():
            if line.startswith("BENCH "):
                yield json.loads(line[6:])


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--mib", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--dir", default="/tmp/bcp-bench")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "checkpoint.json"))
    args = ap.parse_args(argv)
    mib = args.mib or (192 if args.quick else 768)
    reps = args.reps or 3
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    env = {"BCP_TEST_PG_TIMEOUT_S": "900", "PYTHONPATH": HERE}
    timeout = 300 + 60 * reps * max(1, mib // 256)
    common = {"root": args.dir, "mib": mib}

    def ranks(fn, world, **kw):
        return next(bench_lines(run_ranks(f"bench_ranks:{fn}", world, dict(common, **kw), timeout=timeout,
                                          extra_env=env)))

    main_run = ranks("save_and_load", 2, reps=reps)
    r = {k: med(v) for k, v in main_run["results"].items()}
    later = {k: med(v[1:] or v) for k, v in main_run["results"].items() if "stall" in k}  # 2nd+ saves
    parts = main_run["stall_parts"][1:] or main_run["stall_parts"]
    reshard = {}
    tag = str(main_run["last_rep"])
    for w in (1, 3):
        reshard[f"2 -> {w}"] = ranks("resharded_load", w, tag=tag)
    ranks("save_only", 4, tag="w4")
    reshard["4 -> 3"] = ranks("resharded_load", 3, tag="w4")
    rep = ranks("replicated_load", 2, reps=2 if args.quick else 3)
    mib_s = f"{main_run['total_bytes'] / 2**20:.0f} MiB"

    print(f"\nstate: {mib_s} (fp32 params + 2 Adam moments, 4096-wide), FSDP dim-0 shards over 2 gloo ranks; "
          f"{reps} interleaved repetitions, medians; load average {os.getloadavg()[0]:.1f}")
    figure("sync save, FSDP layout, 2 ranks", r["bcp_save"], r["dcp_save"], "<= 0.8", peer_name="dcp.save")
    figure("sync save, FSDP layout, 2 ranks", r["bcp_save"], r["raw_write_fsync"], "<= 1.2",
           peer_name="raw write+fsync of the same bytes")
    figure("async stall (2nd+ save)", later["bcp_async_stall"], r["memcpy"], "<= 1.2",
           peer_name="memcpy of the rank's share into pre-faulted memory")
    figure("async stall (2nd+ save)", later["bcp_async_stall"], later["dcp_async_stall"],
           peer_name="dcp.async_save stall")
    for label in sorted(parts[0]):
        figure(f"async stall part: {label}", med([p[label] for p in parts]), r["memcpy"],
               peer_name="memcpy of the rank's share")
    figure("async save, end to end", r["bcp_async_total"], r["dcp_async_total"], peer_name="dcp.async_save")
    cold = cold_note()
    figure("load, same layout (2 -> 2)", r["bcp_load"], r["dcp_load"], "<= 0.6", peer_name="dcp.load", note=cold)
    targets = {"2 -> 1": "<= 0.5", "2 -> 3": "<= 0.8", "4 -> 3": "<= 0.8"}
    for name, res in reshard.items():
        rr = {k: med(v) for k, v in res["results"].items()}
        figure(f"resharded load {name}", rr["bcp_load"], rr["dcp_load"], targets[name], peer_name="dcp.load", note=cold)
    rr = {k: med(v) for k, v in rep["results"].items()}
    figure("replicated (DDP) load, 2 ranks", rr["bcp_auto"], rr["dcp"], "<= 0.8",
           peer_name="dcp.load", note="zero_redundancy='auto' (off: one host, local files)")
    figure("replicated load, local files: zero-redundancy on", rr["bcp_on"], rr["bcp_off"],
           peer_name="the same load with it off", note="why 'auto' turns it off on one host")
    ck = rep["checkpoint_bytes"]
    figure("replicated load, storage bytes read / checkpoint, zero-redundancy on", rep["rchar"]["bcp_on"] / ck,
           rep["rchar"]["dcp"] / ck, unit="x checkpoint", peer_name="dcp.load")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"main": main_run, "reshard": reshard, "replicated": rep}, f, indent=1)
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
