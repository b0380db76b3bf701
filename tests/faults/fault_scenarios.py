"""Rank functions for the failure tests (run in fresh gloo processes by launcher / harness).

The state is a deterministic function of (version, layout): a row-sharded matrix per rank
(FSDP-like), a replicated tensor (DDP-like), an irregular flat shard (ZeRO-like) and plain values.
Any world size can build its own part of version v, and `check_state` verifies a loaded state
equals version v exactly, so a mixed or stale load is caught.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import bytecheckpoint as bcp

ROWS, COLS = 256, 512          # per big tensor: 512 KiB in float32
N_BIG = 6


def rank_world():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def full(name: str, version: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(_seed(name, version))
    return torch.randn(shape, generator=g)


def _seed(name: str, version: int) -> int:
    import zlib
    return zlib.crc32(f"{name}@{version}".encode())


def build_state(version: int, rank: int, world: int, scale: int = 1, zero: bool = False):
    rows = ROWS * scale
    cuts = [rows * i // world for i in range(world + 1)]
    state = {"model": {}, "meta": {"version": 0 if zero else version, "tag": "" if zero else f"v{version}"}}
    for i in range(N_BIG):
        g = full(f"big{i}", version, (rows, COLS))
        local = g[cuts[rank]:cuts[rank + 1]].clone()
        state["model"][f"big{i}"] = bcp.Shard(torch.zeros_like(local) if zero else local, (rows, COLS),
                                              (cuts[rank], 0))
    rep = full("replicated", version, (64, 64))
    state["model"]["replicated"] = torch.zeros_like(rep) if zero else rep
    numel = 7 * 333
    fc = [0] + [min(numel, numel * i // world + 5) for i in range(1, world)] + [numel]
    flat = full("flat", version, (7, 333)).reshape(-1)[fc[rank]:fc[rank + 1]].clone()
    state["model"]["flat"] = bcp.FlatShard(torch.zeros_like(flat) if zero else flat, (7, 333), fc[rank])
    return state


def check_state(state, version: int, rank: int, world: int, scale: int = 1) -> None:
    want = build_state(version, rank, world, scale)
    assert state["meta"] == want["meta"], f"meta {state['meta']} != {want['meta']}"
    for k, v in want["model"].items():
        got = state["model"][k]
        a = v.local if hasattr(v, "local") else v
        b = got.local if hasattr(got, "local") else got
        assert torch.equal(a, b), f"tensor {k} differs from version {version}"


def load_and_check(path: str, version: int, scale: int = 1, storage_options=None, ckpt=None) -> None:
    """Load `path` at this process's world size and check it is exactly `version`."""
    rank, world = rank_world()
    state = build_state(version, rank, world, scale, zero=True)
    (ckpt or bcp).load(path, state, storage_options=storage_options)
    check_state(state, version, rank, world, scale)


def _mark(marker_dir, name):
    if marker_dir:
        rank, _ = rank_world()
        tmp = os.path.join(marker_dir, f".{name}.{rank}.tmp")
        with open(tmp, "w") as f:
            f.write(str(time.time()))
        os.replace(tmp, os.path.join(marker_dir, f"{name}.{rank}"))


# ---------------------------------------------------------------------- kill trials
def save_version(path, version, async_save=False, overwrite=False, scale=1, marker_dir=None,
                 storage_options=None, ckpt=None):
    """Save version `version`; markers: ready.R just before save(), done.R after it committed."""
    rank, world = rank_world()
    state = build_state(version, rank, world, scale)
    if world > 1:
        dist.barrier()
    _mark(marker_dir, "ready")
    t0 = time.perf_counter()
    h = (ckpt or bcp).save(path, state, async_save=async_save, overwrite=overwrite, storage_options=storage_options)
    if async_save:
        t_stall = time.perf_counter() - t0
        for v in state["model"].values():  # training goes on
            (v.local if hasattr(v, "local") else v).add_(1)
        h.wait()
    else:
        t_stall = time.perf_counter() - t0
    print(f"rank {rank}: SAVE_S {time.perf_counter() - t0:.4f} STALL_S {t_stall:.4f}", flush=True)
    _mark(marker_dir, "done")


def save_then_load(paths, version, scale=1, storage_options=None):
    for path in paths:
        save_version(path, version, scale=scale, storage_options=storage_options)
        load_and_check(path, version, scale, storage_options)
        print(f"rank {rank_world()[0]}: SAVE_LOAD_OK", flush=True)


def save_two(first, second, async_save=False, scale=1, storage_options=None, overwrite=False):
    """Version 1 to `first` (no faults), then version 2 to `second` (where the test's fault fires:
    bcp.save's default Checkpointer takes the rules from BCP_FAULTS)."""
    with bcp.Checkpointer() as fault_free:
        save_version(first, 1, scale=scale, storage_options=storage_options, ckpt=fault_free)
    save_version(second, 2, async_save=async_save, overwrite=overwrite, scale=scale,
                 storage_options=storage_options)


def load_version(path, version, scale=1, storage_options=None):
    load_and_check(path, version, scale, storage_options)
    print(f"rank {rank_world()[0]}: LOAD_OK", flush=True)


# ---------------------------------------------------------------------- expected failures
def expect_failure(op, path, version, error="CheckpointError", match="", async_save=False, scale=1,
                   storage_options=None, max_s=60.0, then_save=True):
    """`op` (save|load) must raise `error` on this rank within max_s seconds."""
    rank, world = rank_world()
    t0 = time.monotonic()
    try:
        if op == "save":
            state = build_state(version, rank, world, scale)
            h = bcp.save(path, state, async_save=async_save, storage_options=storage_options)
            h.wait()
        else:
            load_and_check(path, version, scale, storage_options)
    except Exception as exc:  # noqa: BLE001 - checked below
        took = time.monotonic() - t0
        names = [c.__name__ for c in type(exc).__mro__]
        assert error in names, f"rank {rank}: expected {error}, got {type(exc).__name__}: {exc}"
        assert match in str(exc), f"rank {rank}: {match!r} not in: {exc}"
        assert took < max_s, f"rank {rank}: took {took:.1f}s"
        print(f"rank {rank}: RAISED {type(exc).__name__} in {took:.2f}s: {str(exc)[:3000]}", flush=True)
        if then_save:
            # the fault goes away (a Checkpointer without the rules); this process and its process
            # group stay usable: a later save to a new path works and loads back
            with bcp.Checkpointer() as fault_free:
                save_version(path + "-after", version + 100, scale=scale, storage_options=storage_options,
                             ckpt=fault_free)
                load_and_check(path + "-after", version + 100, scale, storage_options, ckpt=fault_free)
            print(f"rank {rank}: LATER_SAVE_OK", flush=True)
        return
    raise AssertionError(f"rank {rank}: {op} of {path} did not fail")


# ---------------------------------------------------------------------- two jobs, one path
def racing_job(path, version, marker_dir, ranks_total, storage_options=None):
    """One of two independent jobs (own process group) saving to the same path at once: every rank
    of both jobs waits on a file barrier, then all save together."""
    rank, world = rank_world()
    state = build_state(version, rank, world)
    _mark(marker_dir, f"up-{version}")
    deadline = time.monotonic() + 90
    while sum(1 for f in os.listdir(marker_dir) if f.startswith("up-")) < ranks_total:
        if time.monotonic() > deadline:
            raise TimeoutError("the other job never came up")
        time.sleep(0.001)
    try:
        bcp.save(path, state, storage_options=storage_options).wait()
        outcome = "WON"
    except bcp.CheckpointExistsError as exc:
        outcome = f"LOST {str(exc)[:200]}"
    print(f"rank {rank}: JOB {version} {outcome}", flush=True)
    _mark(marker_dir, f"job{version}-{outcome.split()[0]}")


def retention_on_ranks(directory, k):
    import dataclasses
    import json
    from bytecheckpoint import keep_last
    report = keep_last(directory, k)
    print(f"REPORT {json.dumps(dataclasses.asdict(report))}", flush=True)
