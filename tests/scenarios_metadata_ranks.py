"""Ranks of tests/dist/test_metadata_ranks.py: bench_planner's simulated fsdp layout, saved for real.

Each tensor of benchmarks/bench_planner.py's `shapes` (scaled down) is a DTensor Shard(0) over every
rank, built from the same global values on each rank (no communication), as FSDP holds parameters.
"""
from __future__ import annotations

import os
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import bytecheckpoint as bcp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_planner  # noqa: E402


def global_value(t: int, shape) -> torch.Tensor:
    return (torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) % 251 + t).to(torch.bfloat16)


def save_fsdp(path: str, tensors: int, scale: int, saves: int):
    world = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world,))
    state = {f"layers.{t}.w": distribute_tensor(global_value(t, shape), mesh, [Shard(0)], src_data_rank=None)
             for t, shape in enumerate(bench_planner.shapes(tensors, scale))}
    ck = bcp.Checkpointer()
    for i in range(saves):  # the first save plans; the next ones take the cached layout's path
        ck.save(f"{path}/save_{i}", state)
    print("ok", flush=True)
