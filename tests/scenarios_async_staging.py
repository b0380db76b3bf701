"""Async staging on gloo ranks (tests/dist/test_async_staging.py): DDP, FSDP2 (foreach and fused
AdamW) and FSDP1's flat route (use_orig_params True and False). Each rank trains, saves with async
staging while its background copies are slowed, trains on at once (the steps must wait for the
copies: the fence), and the checkpoint must equal a synchronous save of the same state made right
before it (a torn copy would differ, or fail the save through the guard)."""
from __future__ import annotations

import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import bytecheckpoint as bcp
from bytecheckpoint.pipeline import stage


class Net(nn.Module):
    """Big enough that each rank's shards are deferred (>= 64 KiB), with a BatchNorm (copied now)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 512)
        self.norm = nn.BatchNorm1d(512)
        self.down = nn.Linear(512, 64)

    def forward(self, x):
        return self.down(torch.relu(self.norm(self.up(x))))


def build(kind: str):
    torch.manual_seed(0)
    model = Net()
    fused = kind.endswith("fused")
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif kind.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model.up, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=kind == "fsdp1_orig")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, **({"fused": True} if fused else {"foreach": True}))
    return model, optim


def train(model, optim, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(16, 64, generator=g)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()


def same(a, b, where: str) -> None:
    """a == b, recursively and bit for bit; `where` names the first difference."""
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(b, dict):
        assert set(a) == set(b), f"{where}: {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in b:
            same(a[k], b[k], f"{where}/{k}")
    elif isinstance(b, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}/{i}")
    elif isinstance(b, np.ndarray):
        assert np.array_equal(a, b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def run(root: str, kinds: str) -> None:
    rank = dist.get_rank()
    original = stage.copy_deferred

    def slow(pairs):
        time.sleep(0.3)
        original(pairs)
    stage.copy_deferred = slow
    for kind in kinds.split(","):
        model, optim = build(kind)
        train(model, optim, 2, seed=rank)
        state = {"model": model, "optim": optim}
        path, ref = os.path.join(root, kind), os.path.join(root, kind + "-ref")
        with bcp.Checkpointer() as sync:
            sync.save(ref, state)
        with bcp.Checkpointer(async_save=True, async_staging=True) as ckpt:
            h = ckpt.save(path, state)
            train(model, optim, 2, seed=rank + 10)  # at once: the first step waits for this rank's copies
            h.wait()
            deferred, waited = h.stats["deferred_bytes"], h.stats.get("fence_wait_s", 0.0)
        assert waited > 0.1 or not deferred, (kind, dict(h.stats))  # a rank that deferred copies was held
        total = torch.tensor([deferred])
        dist.all_reduce(total)
        assert total.item() > 0, (kind, "nothing was deferred on any rank")
        if rank == 0:
            same(bcp.load_full(path, process_group=bcp.LOCAL), bcp.load_full(ref, process_group=bcp.LOCAL), kind)
        dist.barrier()
        print(f"rank {rank}: async staging {kind} ok ({deferred} bytes deferred, step held {waited:.2f} s)")
    stage.copy_deferred = original
