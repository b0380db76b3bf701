"""Multi-rank scenarios for the resharding matrix (run through launcher.run_ranks).

One checkpoint holds every layout at once, so a save at W and a load at W' cover all layouts in
two launches. Global tensors are deterministic functions of their name; each rank builds its
own part of each layout, and after a load checks its part equals the same slice of the global.
"""
from __future__ import annotations

import math
import os
import random
import zlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard as DShard, distribute_tensor

import bytecheckpoint as bcp


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def full(name: str, shape, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    t = torch.randn(shape, generator=g) * 10
    if dtype == torch.bool:
        return t > 0
    if not dtype.is_floating_point:
        return t.to(torch.int64).to(dtype)
    return t.to(dtype)


def mesh1d(world):
    return init_device_mesh("cpu", (world,))


def mesh2d(world):
    shape = (world // 2, 2) if world % 2 == 0 else (world, 1)
    return init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))


def flat_cuts(numel: int, world: int):
    """Uneven cut points that do not fall on row boundaries."""
    cuts = [0]
    for i in range(1, world):
        cuts.append(min(numel, max(cuts[-1], numel * i // world + (5 if i % 2 else -3))))
    cuts.append(numel)
    return cuts


def build_state(world: int, rank: int, zero: bool):
    """The same logical state, laid out for `world` ranks; zero=True gives empty targets."""
    m1, m2 = mesh1d(world), mesh2d(world)

    def val(name, shape, dtype=torch.float32):
        t = full(name, shape, dtype)
        return torch.zeros_like(t) if zero else t

    def dt(name, shape, mesh, placements, dtype=torch.float32):
        return distribute_tensor(val(name, shape, dtype), mesh, placements, src_data_rank=None)

    flat_shape = (5, 7, 3)
    cuts = flat_cuts(math.prod(flat_shape), world)
    flat_global = val("flat", flat_shape).reshape(-1)
    rows = 8
    row_cuts = [rows * i // world for i in range(world + 1)]
    state = {
        "replicated": val("replicated", (6, 5)),
        "scalar": val("scalar", ()),
        "ints": val("ints", (7,), torch.int64),
        "mask": val("mask", (3, 3), torch.bool),
        "fsdp": dt("fsdp", (10, 6), m1, [DShard(0)]),
        "fsdp_bf16": dt("fsdp_bf16", (11, 3), m1, [DShard(0)], torch.bfloat16),
        "tp": dt("tp", (6, 11), m1, [DShard(1)]),
        "tp_fp16": dt("tp_fp16", (4, 9), m1, [DShard(1)], torch.float16),
        "mesh2d": dt("mesh2d", (9, 7), m2, [DShard(0), DShard(1)]),
        "hsdp": dt("hsdp", (10, 4), m2, [Replicate(), DShard(0)]),
        "fp8": dt("fp8", (12, 2), m1, [DShard(0)], torch.float8_e4m3fn),
        "flat": bcp.FlatShard(flat_global[cuts[rank]:cuts[rank + 1]].clone(), flat_shape, cuts[rank]),
        "box": bcp.Shard(val("box", (rows, 4))[row_cuts[rank]:row_cuts[rank + 1]].clone(), (rows, 4),
                         (row_cuts[rank], 0)),
        "extra": {"step": 0 if zero else 1234, "name": "" if zero else "run-a",
                  "pyrng": None if zero else random.Random(7).getstate(), "lr": [0.0] if zero else [0.1, 0.01]},
    }
    return state


def expected_local(name: str, value):
    """What this rank's part of `value` must equal after loading."""
    specs = {"replicated": ((6, 5), torch.float32), "scalar": ((), torch.float32), "ints": ((7,), torch.int64),
             "mask": ((3, 3), torch.bool), "fsdp": ((10, 6), torch.float32), "fsdp_bf16": ((11, 3), torch.bfloat16),
             "tp": ((6, 11), torch.float32), "tp_fp16": ((4, 9), torch.float16), "mesh2d": ((9, 7), torch.float32),
             "hsdp": ((10, 4), torch.float32), "fp8": ((12, 2), torch.float8_e4m3fn), "flat": ((5, 7, 3), torch.float32),
             "box": ((8, 4), torch.float32)}
    shape, dtype = specs[name]
    g = full(name, shape, dtype)
    if isinstance(value, DTensor):
        return distribute_tensor(g, value.device_mesh, value.placements, src_data_rank=None).to_local(), value.to_local()
    if isinstance(value, bcp.FlatShard):
        return g.reshape(-1)[value.start:value.stop], value.local
    if isinstance(value, bcp.Shard):
        idx = tuple(slice(o, o + n) for o, n in zip(value.offsets, value.local.shape))
        return g[idx], value.local
    return g, value


def save_all(path: str, async_save: bool = False):
    rank, world = rank_world()
    state = build_state(world, rank, zero=False)
    h = bcp.save(path, state, async_save=async_save)
    if async_save:
        # mutate right after save returns: must not leak into the checkpoint
        for k in ("replicated", "ints"):
            state[k].fill_(0)
        state["fsdp"].to_local().fill_(0)
        h.wait()
    print(f"rank {rank}: saved {path}")


def load_all(paths, check_bytes: bool = False, zero_redundancy: bool = False):
    """Load every path; with zero_redundancy, also once more with shared reads forced on (the
    'auto' policy keeps them off for ranks of one host on local files)."""
    rank, world = rank_world()
    shared = bcp.Checkpointer(zero_redundancy=True)
    runs = [(p, bcp.load) for p in paths] + ([(p, shared.load) for p in paths] if zero_redundancy else [])
    for path, load in runs:
        state = build_state(world, rank, zero=True)
        load(path, state)
        for name, value in state.items():
            if name == "extra":
                want = build_state(world, rank, zero=False)["extra"]
                assert value == want, f"{path}: extra {value} != {want}"
                continue
            want, got = expected_local(name, value)
            if want.dtype == torch.float8_e4m3fn:
                want, got = want.view(torch.uint8), got.view(torch.uint8)
            assert torch.equal(want, got), f"{path}: {name} differs on rank {rank} at world {world}"
        print(f"rank {rank}: loaded {path} ok; stats {bcp.last_load_stats}")


def load_corrupt_shared(path: str):
    """A chunk every rank needs is corrupt and read by one rank for all: every rank raises, none hangs."""
    rank, world = rank_world()
    state = build_state(world, rank, zero=True)
    try:
        bcp.Checkpointer(zero_redundancy=True, timeout_s=60).load(path, state)
    except bcp.CheckpointError as exc:
        print(f"rank {rank}: raised {type(exc).__name__}: {exc}")
    else:
        raise AssertionError("a corrupt shared chunk was loaded without an error")
