"""FSDP1 (FullyShardedDataParallel) checkpoints: bytecheckpoint's two routes vs DCP, 2 gloo ranks.

    python benchmarks/bench_fsdp1.py [--quick] [--mib 384] [--reps 3] [--use-orig-params 1|0|both]

A stack of 2048-wide Linear layers, each its own FSDP1 unit, + AdamW state (params + 2 moments =
`--mib`). Compared, interleaved in every repetition (medians reported):
- bcp flat:           bytecheckpoint's default FSDP1 route, per-parameter FlatShards of the local
                      flat shard (no all-gather)
- bcp sharded_tensor: bytecheckpoint through FSDP1's sharded state dict (ShardedTensor)
- dcp:                dcp.save / dcp.load of torch.distributed.checkpoint.state_dict.get_state_dict
Every load starts from zeroed parameters and optimizer state and is checked bit-exact. Prints a
table per use_orig_params and FIGURE lines (benchmarks/figures.py) for run_all.py.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

METHODS = ("bcp_flat", "bcp_sharded_tensor", "dcp")


# ------------------------------------------------------------------ per rank (run through tests/launcher.py)

def _model(mib: int, use_orig_params: bool):
    import torch
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    width = 2048
    per_layer = (width * width + width) * 4 * 3  # params + exp_avg + exp_avg_sq
    layers = max(1, round((mib << 20) / per_layer))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu"),
                 use_orig_params=use_orig_params)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim


def _local_tensors(model, optim):
    """name -> this rank's local tensor (looked up afresh: a load may replace optimizer state tensors)."""
    import torch
    out = {f"param/{n}": p.detach() for n, p in model.named_parameters()}
    for i, p in enumerate(q for g in optim.param_groups for q in g["params"]):
        out.update({f"optim/{i}/{k}": v for k, v in optim.state.get(p, {}).items() if isinstance(v, torch.Tensor)})
    return out


def _save(method, path, model, optim):
    import bytecheckpoint as bcp
    if method.startswith("bcp_"):
        with bcp.Checkpointer(fsdp1_route=method[4:]) as ckpt:
            ckpt.save(path, {"model": model, "optim": optim})
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _load(method, path, model, optim):
    import bytecheckpoint as bcp
    if method.startswith("bcp_"):
        with bcp.Checkpointer(fsdp1_route=method[4:]) as ckpt:
            ckpt.load(path, {"model": model, "optim": optim})
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def ranks_main(root: str, mib: int, reps: int, use_orig_params: bool):
    import torch
    import torch.distributed as dist

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    rank = dist.get_rank()
    model, optim = _model(mib, use_orig_params)
    local = _local_tensors(model, optim)
    total = torch.tensor([sum(t.numel() * t.element_size() for t in local.values())], dtype=torch.float64)
    dist.all_reduce(total)
    snapshot = {k: t.clone() for k, t in local.items()}
    results = {f"{m}_{op}": [] for m in METHODS for op in ("save", "load")}
    for rep in range(reps):
        order = METHODS[rep % len(METHODS):] + METHODS[:rep % len(METHODS)]
        for method in order:
            path = os.path.join(root, f"{method}-{rep}")
            gc.collect()
            results[f"{method}_save"].append(timed(lambda: _save(method, path, model, optim)))
            for t in _local_tensors(model, optim).values():
                t.zero_()
            gc.collect()
            results[f"{method}_load"].append(timed(lambda: _load(method, path, model, optim)))
            got = _local_tensors(model, optim)
            # (a load may add empty state for parameters outside this rank's shard)
            if not all(k in got and torch.equal(got[k], snapshot[k]) for k in snapshot):
                raise AssertionError(f"{method}: load did not restore the saved state")
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    if rank == 0:
        print("BENCH " + json.dumps({"results": results, "total_bytes": float(total.item())}), flush=True)


# ------------------------------------------------------------------ driver

def main(argv=None) -> int:
    from figures import figure
    from launcher import run_ranks
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=384)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--use-orig-params", choices=("1", "0", "both"), default="both")
    ap.add_argument("--quick", action="store_true", help="96 MiB, 2 repetitions (also BCP_BENCH_QUICK=1)")
    ap.add_argument("--dir", default="/tmp/bcp-bench-fsdp1")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "fsdp1.md"))
    args = ap.parse_args(argv)
    if args.quick or os.environ.get("BCP_BENCH_QUICK") == "1":
        args.mib, args.reps = 96, 2
    variants = (True, False) if args.use_orig_params == "both" else (args.use_orig_params == "1",)
    lines, runs = [], {}
    for orig in variants:
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
        outs = run_ranks("bench_fsdp1:ranks_main", 2, {"root": args.dir, "mib": args.mib, "reps": args.reps,
                                                       "use_orig_params": orig},
                         timeout=300 + 120 * args.reps * max(1, args.mib // 256), extra_env={"PYTHONPATH": HERE})
        run = next(json.loads(line[6:]) for o in outs for line in o.splitlines() if line.startswith("BENCH "))
        runs[f"use_orig_params={orig}"] = run
        r = {k: statistics.median(v) for k, v in run["results"].items()}
        mib = run["total_bytes"] / 2**20
        lines += [f"FSDP1 (use_orig_params={orig}), 2 gloo ranks, {mib:.0f} MiB of model + AdamW state (2048-wide "
                  f"Linear layers, one FSDP unit each); {args.reps} interleaved repetitions, medians; every load "
                  f"restores zeroed state and is checked bit-exact; load average {os.getloadavg()[0]:.1f}.", "",
                  "| operation | bcp flat (s) | bcp sharded_tensor (s) | DCP (s) | flat / DCP | sharded_tensor / DCP |",
                  "|---|---|---|---|---|---|"]
        for op, what, target in (("save", "sync save", "<= 0.8"), ("load", "load (2 -> 2)", "<= 0.9")):
            f, s, d = r[f"bcp_flat_{op}"], r[f"bcp_sharded_tensor_{op}"], r[f"dcp_{op}"]
            lines.append(f"| {what} | {f:.3f} | {s:.3f} | {d:.3f} | {f / d:.2f} | {s / d:.2f} |")
            peer = "dcp.save" if op == "save" else "dcp.load + set_state_dict"
            figure(f"FSDP1 {what}, flat route (default), use_orig_params={orig}", f, d, target, peer_name=peer)
            figure(f"FSDP1 {what}, ShardedTensor route, use_orig_params={orig}", s, d, peer_name=peer)
        lines.append("")
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    with open(args.out.replace(".md", ".json"), "w") as f:
        json.dump(runs, f, indent=1)
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
