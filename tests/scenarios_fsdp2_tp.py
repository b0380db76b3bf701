"""FSDP2 over tensor parallel (the torchtitan layout), HSDP, and refusals, on 4 CPU gloo ranks.

The model is built as torchtitan builds it: parallelize_module with ColwiseParallel /
RowwiseParallel on the "tp" mesh, then fully_shard on the "dp" mesh of each block and the root.
Column-wise weights then carry (_StridedShard(0, sf=2), Shard(0)). The same launch saves an HSDP
(Replicate x Shard) model, whose replicated bytes must be written exactly once, and checks that a
Partial placement is refused before anything is written.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

import bytecheckpoint as bcp
from bytecheckpoint.common.torch_compat import strided_shard_class
from scenarios_fsdp1 import full_state as full_state_and_groups
from scenarios_fsdp1 import rank_world, train


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 26)      # 26 rows: uneven over dp x tp
        self.down = nn.Linear(26, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(13, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(16, 7)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


HSDP = ("hsdp", "fsdp1_hsdp")


def build(kind: str, seed: int = 0):
    """kind: 'fsdp_tp' (2x2 dp x tp), 'hsdp' (FSDP2, 2x2 replicate x shard), 'fsdp1_hsdp' (FSDP1
    HYBRID_SHARD on the same mesh), 'fsdp' (FSDP2, 1-D), 'plain'."""
    torch.manual_seed(seed)
    model = Net()
    world = rank_world()[1]
    if kind == "fsdp_tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        shard_mesh = mesh["dp"]
    elif kind == "hsdp":
        shard_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    elif kind == "fsdp":
        shard_mesh = init_device_mesh("cpu", (world,))
    elif kind == "fsdp1_hsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        model = FSDP(model, device_mesh=mesh, sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                     auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"), use_orig_params=True)
    if kind not in ("plain", "fsdp1_hsdp"):
        for b in model.blocks:
            fully_shard(b, mesh=shard_mesh)
        fully_shard(model, mesh=shard_mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optim


def full_state(model, optim):
    """Model and optimizer state as DCP's full state dict gives it: name -> full tensor."""
    return full_state_and_groups(model, optim)[0]


def strided_extra(mesh) -> DTensor:
    """A DTensor whose every rank holds a union of two boxes: (Shard(0), _StridedShard(0, sf=2)).
    Its full value is arange(24).reshape(8, 3) (save_all's reference)."""
    full = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    return distribute_tensor(full, mesh, [Shard(0), strided_shard_class()(0, split_factor=2)])


def save_all(root: str):
    rank, world = rank_world()
    assert world == 4
    # 1. FSDP2 + TP, the torchtitan layout
    model, optim = build("fsdp_tp")
    strided = strided_shard_class()
    placements = {k: tuple(v.placements) for k, v in model.state_dict().items()}
    assert any(isinstance(p[0], strided) for p in placements.values()), placements
    train(model, optim, 3, seed=rank // 2)  # the two tp ranks of a dp group see the same batch
    extra = strided_extra(init_device_mesh("cpu", (2, 2)))
    bcp.save(os.path.join(root, "tp"), {"model": model, "optim": optim, "extra": extra})
    ref = full_state(model, optim)
    # the full tensor strided_extra distributed (torch 2.11's full_tensor() cannot gather this layout:
    # its redistribute planner lacks the fallback 2.13 has for (Shard(0), _StridedShard(0, sf=2)))
    ref["extra"] = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    if rank == 0:
        torch.save(ref, os.path.join(root, "tp.ref.pt"))
        _check_written_once(os.path.join(root, "tp"), world)

    # 2. HSDP (Replicate x Shard), FSDP2 and FSDP1: replicated shards are written once, spread over
    #    the replicas
    for name in HSDP:
        model, optim = build(name)
        train(model, optim, 2, seed=0)  # replicas of a shard must see the same batches: all do here
        bcp.save(os.path.join(root, name), {"model": model, "optim": optim})
        ref = full_state(model, optim)
        if rank == 0:
            torch.save(ref, os.path.join(root, name + ".ref.pt"))
            _check_written_once(os.path.join(root, name), world)

    # 3. a Partial placement is refused on every rank before anything is written
    mesh = init_device_mesh("cpu", (world,))
    partial = DTensor.from_local(torch.ones(4, 2), mesh, [Partial()])
    bad = os.path.join(root, "partial")
    try:
        bcp.save(bad, {"model": model, "loss_sum": partial})
    except bcp.CheckpointError as exc:
        msg = str(exc)
        assert "'loss_sum'" in msg and "Partial" in msg and "Supported placements" in msg, msg
        assert "redistribute" in msg and "Nothing was written" in msg, msg
    else:
        raise AssertionError("a Partial DTensor was saved")
    dist.barrier()
    written = [os.path.join(d, f) for d, _, fs in os.walk(bad) for f in fs] if os.path.exists(bad) else []
    assert written == [], written
    print(f"rank {rank}: fsdp2+tp, hsdp, refusal ok")


def _check_written_once(path: str, world: int) -> None:
    info = bcp.inspect(path)
    logical = sum(t.nbytes for t in info.tensors)
    per_rank = info.info["bytes_per_rank"]
    assert sum(per_rank) == logical, (path, per_rank, logical)  # every byte written exactly once
    assert max(per_rank) <= 1.5 * logical / world, (path, per_rank, logical)
    print(f"{path}: {logical} bytes, written per rank {per_rank}")


def load_all(root: str, kind: str):
    """Load both checkpoints into `kind` ('fsdp' on any world size, or 'plain') and compare bit for bit."""
    rank, world = rank_world()
    if kind != "plain" and not dist.is_initialized():
        dist.init_process_group("gloo")
    for name in ("tp",) + HSDP:
        model, optim = build(kind, seed=1234)
        state = {"model": model, "optim": optim}
        if name == "tp":
            state["extra"] = torch.zeros(8, 3)
        bcp.load(os.path.join(root, name), state)
        ref = torch.load(os.path.join(root, name + ".ref.pt"))
        got = full_state(model, optim)
        if name == "tp":
            got["extra"] = state["extra"]
        assert set(got) == set(ref), sorted(set(got) ^ set(ref))
        for k in ref:
            assert torch.equal(got[k], ref[k]), (name, k)
        train(model, optim, 1, seed=7)
        print(f"rank {rank}: {name} -> {kind} x{world} ok")
