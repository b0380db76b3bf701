"""Per-rank bodies of bench_checkpoint.py (run on gloo ranks through tests/launcher.py).

Every function prints one JSON line `BENCH {...}` on rank 0 with its measurements.
"""
from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import time
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import bytecheckpoint as bcp


def rank_world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def llm_like_state(world: int, mib: int, sharded: bool) -> Dict[str, torch.Tensor]:
    """fp32 params + two Adam moments, 4096-wide matrices and norms, `mib` MiB in total."""
    mesh = init_device_mesh("cpu", (world,))
    width = 4096
    per_matrix = width * width * 4
    n_mats = max(1, (mib << 20) // 3 // per_matrix)
    rows = ((mib << 20) // 3 // n_mats) // (width * 4)
    g = torch.Generator().manual_seed(0)
    state = {}
    for part in ("param", "exp_avg", "exp_avg_sq"):
        for i in range(n_mats):
            full = torch.randn(rows, width, generator=g)
            state[f"{part}.layers.{i}.w"] = full
            state[f"{part}.layers.{i}.norm"] = torch.randn(width, generator=g)
    placement = [Shard(0)] if sharded else [Replicate()]
    return {k: distribute_tensor(v, mesh, placement if v.dim() == 2 else [Replicate()], src_data_rank=None)
            for k, v in state.items()}


def state_bytes(state) -> int:
    return sum(v.numel() * v.element_size() for v in state.values())


def local_bytes(state) -> int:
    return sum((v.to_local() if isinstance(v, DTensor) else v).numel() * v.element_size() for v in state.values())


def barrier():
    if dist.is_initialized():
        dist.barrier()


def timed(fn) -> float:
    barrier()
    t0 = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - t0


def max_over_ranks(x: float) -> float:
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def sum_over_ranks(x: float) -> float:
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def fresh(path: str) -> str:
    rank, _ = rank_world()
    barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    barrier()
    return path


def emit(**kw):
    if rank_world()[0] == 0:
        print("BENCH " + json.dumps(kw), flush=True)


def zeros_like_state(state):
    out = {}
    for k, v in state.items():
        if isinstance(v, DTensor):
            out[k] = DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements,
                                        shape=v.shape, stride=v.stride())
        else:
            out[k] = torch.zeros_like(v)
    return out


def check_equal(a, b):
    for k in a:
        x, y = a[k], b[k]
        x = x.to_local() if isinstance(x, DTensor) else x
        y = y.to_local() if isinstance(y, DTensor) else y
        assert torch.equal(x, y), k


def time_loads(state, root: str, rep: int, results: Dict[str, List[float]]) -> None:
    """Load repetition `rep`'s bcp and dcp checkpoints into zeroed copies of `state`, timed and checked."""
    tgt = zeros_like_state(state)
    results["bcp_load"].append(timed(lambda: bcp.load(f"{root}/bcp_{rep}", tgt)))
    check_equal(state, tgt)
    tgt = zeros_like_state(state)
    results["dcp_load"].append(timed(lambda: dcp.load(tgt, checkpoint_id=f"{root}/dcp_{rep}")))
    check_equal(state, tgt)


# ------------------------------------------------------------------ save / stall / same-layout load

def save_and_load(root: str, mib: int, reps: int):
    rank, world = rank_world()
    state = llm_like_state(world, mib, sharded=True)
    results: Dict[str, List[float]] = {k: [] for k in (
        "bcp_save", "dcp_save", "torch_save_rank0", "raw_write_fsync", "bcp_load", "dcp_load", "torch_load_rank0",
        "bcp_async_stall", "dcp_async_stall", "memcpy", "bcp_async_total", "dcp_async_total")}
    local = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in state.items()}
    # rank 0 holds the full state for the torch.save baseline (what Lightning's default does)
    fulls = {k: v.full_tensor() for k, v in state.items()}
    prefaulted = {k: torch.empty_like(v).zero_() for k, v in local.items()}
    for rep in range(reps):
        # interleave peers within each repetition
        p = fresh(f"{root}/bcp_{rep}")
        results["bcp_save"].append(timed(lambda: bcp.save(p, state)))
        p = fresh(f"{root}/dcp_{rep}")
        results["dcp_save"].append(timed(lambda: dcp.save(state, checkpoint_id=p)))
        p = fresh(f"{root}/torch_{rep}.pt")

        def tsave():
            if rank == 0:
                with open(p, "wb") as f:
                    torch.save(fulls, f)
                    f.flush()
                    os.fsync(f.fileno())
        results["torch_save_rank0"].append(timed(tsave))
        p = fresh(f"{root}/raw_{rep}")

        def raw():
            os.makedirs(p, exist_ok=True)
            with open(f"{p}/rank{rank}.bin", "wb") as f:
                for v in local.values():
                    f.write(v.numpy().tobytes() if not v.is_contiguous() else memoryview(v.numpy()).cast("B"))
                f.flush()
                os.fsync(f.fileno())
        results["raw_write_fsync"].append(timed(raw))

        def memcpy():
            for k, v in local.items():
                prefaulted[k].copy_(v)
        results["memcpy"].append(timed(memcpy))

        # loads (same layout) of what this repetition wrote
        time_loads(state, root, rep, results)

        def tload():
            if rank == 0:
                torch.load(f"{root}/torch_{rep}.pt", weights_only=True)
        results["torch_load_rank0"].append(timed(tload))

        # async: stall is the time save() blocks the caller; later saves reuse the staging pool
        p = fresh(f"{root}/bcpa_{rep}")
        barrier()
        t0 = time.perf_counter()
        h = bcp.save(p, state, async_save=True)
        stall = time.perf_counter() - t0
        h.wait()
        total = time.perf_counter() - t0
        results["bcp_async_stall"].append(max_over_ranks(stall))
        results["bcp_async_total"].append(max_over_ranks(total))
        p = fresh(f"{root}/dcpa_{rep}")
        barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=p)
        stall = time.perf_counter() - t0
        fut.result()
        total = time.perf_counter() - t0
        results["dcp_async_stall"].append(max_over_ranks(stall))
        results["dcp_async_total"].append(max_over_ranks(total))
        for d in ("bcp", "dcp", "torch", "raw", "bcpa", "dcpa"):
            barrier()
            if rank == 0 and rep < reps - 1:  # keep the last rep's checkpoints for the reshard runs
                shutil.rmtree(f"{root}/{d}_{rep}", ignore_errors=True)
                if d == "torch":
                    try:
                        os.remove(f"{root}/torch_{rep}.pt")
                    except FileNotFoundError:
                        pass
        gc.collect()
    emit(kind="save_load", world=world, total_bytes=state_bytes(state), reps=reps,
         results=results, last_rep=reps - 1)


def resharded_load(root: str, mib: int, rep: int):
    """Load the W=2 checkpoints (bcp and dcp) at this world size."""
    rank, world = rank_world()
    state = llm_like_state(world, mib, sharded=True)
    results = {"bcp_load": [], "dcp_load": []}
    for _ in range(2):
        time_loads(state, root, rep, results)
    emit(kind="reshard", world=world, results=results)


def replicated_bytes_read(root: str, mib: int):
    """Storage bytes read by all ranks for a replicated (DDP) load, bcp vs dcp."""
    rank, world = rank_world()
    state = llm_like_state(world, mib, sharded=False)
    pb, pd = fresh(f"{root}/rep_bcp"), fresh(f"{root}/rep_dcp")
    bcp.save(pb, state)
    dcp.save(state, checkpoint_id=pd)
    out = {}
    for name, fn in (("bcp", lambda t: bcp.load(pb, t)), ("dcp", lambda t: dcp.load(t, checkpoint_id=pd))):
        tgt = zeros_like_state(state)
        barrier()
        before = rchar()
        t = timed(lambda: fn(tgt))
        read = sum_over_ranks(rchar() - before)
        check_equal(state, tgt)
        out[name] = {"bytes_read": read, "seconds": t}
    out["bcp_stats_bytes_read"] = sum_over_ranks(bcp.last_load_stats.bytes_read)
    emit(kind="replicated_read", world=world, checkpoint_bytes=state_bytes(state), results=out)
