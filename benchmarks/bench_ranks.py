"""Per-rank bodies of bench_checkpoint.py (run on gloo ranks through tests/launcher.py).

Every function prints one JSON line `BENCH {...}` on rank 0 with its measurements.
"""
from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import threading
import time
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import bytecheckpoint as bcp
from bench_real_model import cold_start  # noqa: E402 - loads read cold (BCP_BENCH_WARM_LOADS=1: as found)


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


def time_loads(state, bcp_path: str, dcp_path: str, results: Dict[str, List[float]], ckpt=None) -> None:
    """Load the bcp and dcp checkpoints into zeroed copies of `state`, timed and checked; each load
    cold (cold_start), as a resume in a new process reads them."""
    ckpt = ckpt or bcp
    tgt = zeros_like_state(state)
    cold_start()
    results["bcp_load"].append(timed(lambda: ckpt.load(bcp_path, tgt)))
    check_equal(state, tgt)
    tgt = zeros_like_state(state)
    cold_start()
    results["dcp_load"].append(timed(lambda: dcp.load(tgt, checkpoint_id=dcp_path)))
    check_equal(state, tgt)


class StallParts:
    """Times the steps of an async save on the training thread (bench-only instrumentation)."""

    def __init__(self):
        from bytecheckpoint.pipeline import save_plan, staging, workers
        from bytecheckpoint.collectives.comm import Comm
        self.parts: Dict[str, float] = {}
        self.on = False
        self.thread = threading.main_thread()  # only the training thread's calls count
        for label, owner, name in (("arrival check (monitored barrier)", Comm, "arrive"),
                                   ("flatten + manifest", save_plan, "prepare"),
                                   ("plan check + failure agreement (cached: one all-reduce + broadcast)", save_plan,
                                    "plan"),
                                   ("copy into the staging slot", staging.StagingPool, "stage"),
                                   ("background thread start", workers.BackgroundRunner, "submit")):
            self._wrap(label, owner, name)

    def _wrap(self, label, owner, name):
        orig = getattr(owner, name)

        def timed_call(*a, **k):
            if not self.on or threading.current_thread() is not self.thread:
                return orig(*a, **k)
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                self.parts[label] = self.parts.get(label, 0.0) + time.perf_counter() - t0
        setattr(owner, name, timed_call)


# ------------------------------------------------------------------ save / stall / same-layout load

def save_and_load(root: str, mib: int, reps: int):
    rank, world = rank_world()
    state = llm_like_state(world, mib, sharded=True)
    results: Dict[str, List[float]] = {k: [] for k in (
        "bcp_save", "dcp_save", "raw_write_fsync", "bcp_load", "dcp_load", "bcp_async_stall", "dcp_async_stall",
        "memcpy", "bcp_async_total", "dcp_async_total")}
    parts: List[Dict[str, float]] = []
    local = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in state.items()}
    prefaulted = {k: torch.empty_like(v).zero_() for k, v in local.items()}
    stall = StallParts()
    for rep in range(reps):
        # interleave peers within each repetition
        p = fresh(f"{root}/bcp_{rep}")
        results["bcp_save"].append(timed(lambda: bcp.save(p, state)))
        p = fresh(f"{root}/dcp_{rep}")
        results["dcp_save"].append(timed(lambda: dcp.save(state, checkpoint_id=p)))
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
        time_loads(state, f"{root}/bcp_{rep}", f"{root}/dcp_{rep}", results)

        # async: stall is the time save() blocks the caller; later saves reuse the staging pool
        p = fresh(f"{root}/bcpa_{rep}")
        barrier()
        stall.parts, stall.on = {}, True
        t0 = time.perf_counter()
        h = bcp.save(p, state, async_save=True)
        took = time.perf_counter() - t0
        stall.on = False
        labels = ("arrival check (monitored barrier)", "flatten + manifest",
                  "plan check + failure agreement (cached: one all-reduce + broadcast)", "copy into the staging slot",
                  "background thread start")  # the same collectives on every rank
        parts.append({k: max_over_ranks(stall.parts.get(k, 0.0)) for k in labels})
        h.wait()
        total = time.perf_counter() - t0
        results["bcp_async_stall"].append(max_over_ranks(took))
        results["bcp_async_total"].append(max_over_ranks(total))
        p = fresh(f"{root}/dcpa_{rep}")
        barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=p)
        took = time.perf_counter() - t0
        fut.result()
        total = time.perf_counter() - t0
        results["dcp_async_stall"].append(max_over_ranks(took))
        results["dcp_async_total"].append(max_over_ranks(total))
        for d in ("bcp", "dcp", "raw", "bcpa", "dcpa"):
            barrier()
            if rank == 0 and rep < reps - 1:  # keep the last rep's checkpoints for the reshard runs
                shutil.rmtree(f"{root}/{d}_{rep}", ignore_errors=True)
        gc.collect()
    emit(kind="save_load", world=world, total_bytes=state_bytes(state), reps=reps,
         results=results, stall_parts=parts, last_rep=reps - 1)


def save_only(root: str, mib: int, tag: str):
    """Write one bcp and one dcp checkpoint of the sharded state at this world size (untimed)."""
    _, world = rank_world()
    state = llm_like_state(world, mib, sharded=True)
    bcp.save(fresh(f"{root}/bcp_{tag}"), state)
    dcp.save(state, checkpoint_id=fresh(f"{root}/dcp_{tag}"))
    emit(kind="saved", world=world)


def resharded_load(root: str, mib: int, tag: str, reps: int = 2):
    """Load the checkpoints `tag` (bcp and dcp, saved at another world size) at this world size."""
    _, world = rank_world()
    state = llm_like_state(world, mib, sharded=True)
    results = {"bcp_load": [], "dcp_load": []}
    for _ in range(reps):
        time_loads(state, f"{root}/bcp_{tag}", f"{root}/dcp_{tag}", results)
    emit(kind="reshard", world=world, results=results)


def replicated_load(root: str, mib: int, reps: int = 2):
    """Replicated (DDP) state: load time bcp (zero-redundancy by policy, on, off) vs dcp, and the
    storage bytes all ranks read (/proc/self/io rchar)."""
    _, world = rank_world()
    state = llm_like_state(world, mib, sharded=False)
    pb, pd = fresh(f"{root}/rep_bcp"), fresh(f"{root}/rep_dcp")
    bcp.save(pb, state)
    dcp.save(state, checkpoint_id=pd)
    engines = {"auto": bcp.Checkpointer(), "on": bcp.Checkpointer(zero_redundancy=True),
               "off": bcp.Checkpointer(zero_redundancy=False)}
    results: Dict[str, List[float]] = {}
    read: Dict[str, float] = {}
    for _ in range(reps):
        for name, fn in [(f"bcp_{k}", (lambda e: lambda t: e.load(pb, t))(e)) for k, e in engines.items()] + [
                ("dcp", lambda t: dcp.load(t, checkpoint_id=pd))]:
            tgt = zeros_like_state(state)
            cold_start()
            before = rchar()
            results.setdefault(name, []).append(timed(lambda: fn(tgt)))
            read[name] = sum_over_ranks(rchar() - before)
            check_equal(state, tgt)
    counted = sum_over_ranks(engines["on"].last_load_stats.bytes_read)
    for e in engines.values():
        e.close()
    emit(kind="replicated", world=world, checkpoint_bytes=state_bytes(state), results=results, rchar=read,
         bcp_on_bytes_read=counted)


# ------------------------------------------------------------------ object store (bench_s3.py)

def _s3fs_kwargs(opts):
    return {"key": opts["access_key_id"], "secret": opts["secret_access_key"],
            "client_kwargs": {"endpoint_url": opts["endpoint"], "region_name": "us-east-1"}}


def _time_floor(store, rank: int, pieces, results: Dict[str, List[float]]) -> None:
    """The store's floor: the same bytes as 16 MiB objects through the same client, all in flight,
    no checkpoint logic (raw_put, raw_get)."""
    keys = [f"rank{rank}/{i}" for i in range(len(pieces))]
    results["raw_put"].append(timed(lambda: [r.result() for r in [store.write(k, p) for k, p in zip(keys, pieces)]]))
    results["raw_get"].append(timed(lambda: [r.result() for r in [store.read(k) for k in keys]]))


def s3_save_load(url: str, opts: dict, mib: int, reps: int):
    """FSDP state on the object store: bcp save/load vs DCP + fsspec/s3fs, interleaved."""
    rank, world = rank_world()
    state = llm_like_state(world, mib, sharded=True)
    ckpt = bcp.Checkpointer(storage_options=opts)
    try:
        import s3fs  # noqa: F401
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
        have_s3fs = True
    except ImportError:
        have_s3fs = False
    results: Dict[str, List[float]] = {"bcp_save": [], "bcp_load": [], "dcp_save": [], "dcp_load": [],
                                       "raw_put": [], "raw_get": []}
    local = [(v.to_local() if isinstance(v, DTensor) else v).contiguous() for v in state.values()]
    pieces = [memoryview(p.numpy()).cast("B") for t in local for p in t.view(-1).split(4 << 20)]  # 16 MiB fp32
    for rep in range(reps):
        _time_floor(ckpt.storage(f"{url}/raw_{rep}"), rank, pieces, results)
        path = f"{url}/bcp_{rep}"
        results["bcp_save"].append(timed(lambda: ckpt.save(path, state)))
        tgt = zeros_like_state(state)
        results["bcp_load"].append(timed(lambda: ckpt.load(path, tgt)))
        check_equal(state, tgt)
        if have_s3fs:
            dpath = f"{url}/dcp_{rep}"
            kw = _s3fs_kwargs(opts)
            results["dcp_save"].append(timed(lambda: dcp.save(state, storage_writer=FsspecWriter(dpath, **kw))))
            tgt = zeros_like_state(state)
            results["dcp_load"].append(timed(lambda: dcp.load(tgt, storage_reader=FsspecReader(dpath, **kw))))
            check_equal(state, tgt)
        barrier()
        if rank == 0:
            ckpt.delete(path)
    ckpt.close()
    emit(kind="s3", world=world, total_bytes=state_bytes(state), results=results, have_s3fs=have_s3fs)


def s3_replicated(url: str, opts: dict, mib: int, reps: int):
    """Replicated (DDP) state on the object store: load with zero-redundancy on vs off."""
    _, world = rank_world()
    state = llm_like_state(world, mib, sharded=False)
    engines = {"on": bcp.Checkpointer(storage_options=opts, zero_redundancy=True),
               "off": bcp.Checkpointer(storage_options=opts, zero_redundancy=False),
               "auto": bcp.Checkpointer(storage_options=opts)}
    path = f"{url}/rep_bcp"
    engines["on"].save(path, state)
    results: Dict[str, List[float]] = {k: [] for k in engines}
    stats: Dict[str, float] = {}
    for _ in range(reps):
        for name, e in engines.items():
            tgt = zeros_like_state(state)
            results[name].append(timed(lambda: e.load(path, tgt)))
            check_equal(state, tgt)
            stats[name] = sum_over_ranks(e.last_load_stats.bytes_read)
    for e in engines.values():
        e.close()
    emit(kind="s3_replicated", world=world, total_bytes=state_bytes(state), results=results, bytes_read=stats)


def s3_real_model(url: str, opts: dict, blocks: int, reps: int):
    """The Llama-shaped model of bench_real_model.py, FSDP2 on every rank, with AdamW state, on the
    object store: bcp save/load against the same bytes as 16 MiB PUTs/GETs (the store's floor),
    and the objects one save writes."""
    from bench_real_model import model_and_optim
    from torch.distributed.checkpoint.state_dict import get_state_dict
    rank, world = rank_world()
    model, optim = model_and_optim(blocks, fsdp=True)
    msd, osd = get_state_dict(model, optim)
    tensors = [v for v in msd.values() if isinstance(v, torch.Tensor)]
    tensors += [t for s in osd["state"].values() for t in s.values() if isinstance(t, torch.Tensor)]
    local = [(t.to_local() if isinstance(t, DTensor) else t).detach().contiguous() for t in tensors]
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in local])
    pieces = [memoryview(p.numpy()).cast("B") for p in flat.split(16 << 20)]
    ckpt = bcp.Checkpointer(storage_options=opts)
    state = {"model": model, "optim": optim}
    results: Dict[str, List[float]] = {"bcp_save": [], "bcp_load": [], "raw_put": [], "raw_get": [], "objects": []}
    for rep in range(reps):
        _time_floor(ckpt.storage(f"{url}/raw_real_{rep}"), rank, pieces, results)
        path = f"{url}/real_{rep}"
        results["bcp_save"].append(timed(lambda: ckpt.save(path, state)))
        if rank == 0:
            results["objects"].append(len(ckpt.storage(path).list()))
        results["bcp_load"].append(timed(lambda: ckpt.load(path, state)))
        barrier()
        if rank == 0:
            ckpt.delete(path)
    total = torch.tensor([flat.numel()], dtype=torch.int64)
    dist.all_reduce(total)
    ckpt.close()
    emit(kind="s3_real", world=world, total_bytes=int(total.item()), results=results)
