"""bytecheckpoint vs torch.save, DCP (sync + async), raw write+fsync and memcpy, in one run.

    python benchmarks/bench_checkpoint.py [--mib 768] [--reps 3] [--dir /tmp/bcp-bench]

An LLM-like state (4096-wide fp32 matrices + norms, params and two Adam moments) sharded over
2 gloo ranks (FSDP-style, dim 0). Peers are interleaved inside every repetition; medians are
reported with ratios bytecheckpoint / peer (lower is better for times).
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
    ap.add_argument("--mib", type=int, default=768)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/bcp-bench")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "checkpoint.md"))
    args = ap.parse_args(argv)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    env = {"PYTHONPATH": HERE}
    timeout = 120 + 60 * args.reps * max(1, args.mib // 256)
    common = {"root": args.dir, "mib": args.mib}
    main_run = next(bench_lines(run_ranks("bench_ranks:save_and_load", 2, dict(common, reps=args.reps),
                                          timeout=timeout, extra_env=env)))
    r = {k: med(v) for k, v in main_run["results"].items()}
    stall2 = {k: med(v[1:] or v) for k, v in main_run["results"].items() if "stall" in k}
    reshard = {}
    for w in (1, 3):
        res = next(bench_lines(run_ranks("bench_ranks:resharded_load", w, dict(common, rep=main_run["last_rep"]),
                                         timeout=timeout, extra_env=env)))
        reshard[w] = {k: med(v) for k, v in res["results"].items()}
    rep = next(bench_lines(run_ranks("bench_ranks:replicated_bytes_read", 2, common, timeout=timeout,
                                     extra_env=env)))
    gib = main_run["total_bytes"] / 2**30
    lines = [f"State: {gib * 1024:.0f} MiB (fp32 params + 2 Adam moments, 4096-wide), 2 gloo ranks, "
             f"FSDP-style dim-0 shards; {args.reps} interleaved repetitions, medians.", "",
             "| operation | bytecheckpoint (s) | peer | peer (s) | ratio bcp/peer | target |",
             "|---|---|---|---|---|---|"]

    def row(op, ours, peer, theirs, target=""):
        lines.append(f"| {op} | {ours:.3f} | {peer} | {theirs:.3f} | {ours / theirs:.2f} | {target} |")
    row("sync save", r["bcp_save"], "dcp.save", r["dcp_save"], "<= 0.8")
    row("sync save", r["bcp_save"], "torch.save on rank 0 (+fsync)", r["torch_save_rank0"])
    row("sync save", r["bcp_save"], "raw write+fsync (disk limit)", r["raw_write_fsync"])
    row("async stall (2nd+ save)", stall2["bcp_async_stall"], "dcp.async_save stall", stall2["dcp_async_stall"], "<= 0.5")
    row("async stall (2nd+ save)", stall2["bcp_async_stall"], "memcpy into pre-faulted memory", r["memcpy"], "<= 1.5")
    row("async save, end to end", r["bcp_async_total"], "dcp.async_save end to end", r["dcp_async_total"])
    row("load, same layout (2 -> 2)", r["bcp_load"], "dcp.load", r["dcp_load"], "<= 0.9")
    row("load, same layout (2 -> 2)", r["bcp_load"], "torch.load on rank 0", r["torch_load_rank0"])
    for w in (1, 3):
        row(f"resharded load 2 -> {w}", reshard[w]["bcp_load"], "dcp.load", reshard[w]["dcp_load"], "<= 0.8")
    rr = rep["results"]
    ck = rep["checkpoint_bytes"]
    lines += ["", "Replicated (DDP) state, W=2 load, storage bytes read by all ranks (/proc/self/io rchar):", "",
              "| | bytes read | x checkpoint | load (s) |", "|---|---|---|---|",
              f"| bytecheckpoint | {rr['bcp']['bytes_read'] / 2**20:.0f} MiB | {rr['bcp']['bytes_read'] / ck:.2f} | "
              f"{rr['bcp']['seconds']:.3f} |",
              f"| dcp.load | {rr['dcp']['bytes_read'] / 2**20:.0f} MiB | {rr['dcp']['bytes_read'] / ck:.2f} | "
              f"{rr['dcp']['seconds']:.3f} |",
              f"", f"(bytecheckpoint's own counter: {rr['bcp_stats_bytes_read'] / ck:.2f} x checkpoint; target <= 1.05)"]
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    with open(args.out.replace(".md", ".json"), "w") as f:
        json.dump({"main": main_run, "reshard": reshard, "replicated": rep}, f, indent=1)
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
