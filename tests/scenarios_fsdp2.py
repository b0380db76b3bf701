"""FSDP2 (fully_shard) + optimizer scenarios on CPU gloo ranks, and replicated disk usage."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import bytecheckpoint as bcp


def model_and_optim(world: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 24), nn.ReLU(), nn.Linear(24, 7))  # 13, 7: uneven over 2-4 ranks
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def full_state(model, optim):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    out = {}
    for k, v in get_model_state_dict(model).items():
        out[f"model/{k}"] = v.full_tensor() if isinstance(v, DTensor) else v
    osd = get_optimizer_state_dict(model, optim)
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim/{fqn}/{k}"] = v.full_tensor() if isinstance(v, DTensor) else v
    return out


def train(model, optim, rank: int, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        loss = model(torch.randn(4, 13, generator=g)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()


def train_and_save(path: str, reference: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optim = model_and_optim(world)
    train(model, optim, rank)
    bcp.save(path, {"model": model, "optim": optim, "step": 3, "note": f"saved at {world}"})
    ref = full_state(model, optim)
    if rank == 0:
        torch.save(ref, reference)


def load_and_compare(path: str, reference: str):
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if world == 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    model, optim = model_and_optim(world)
    state = bcp.load(path, {"model": model, "optim": optim, "step": 0, "note": ""})
    assert state["step"] == 3 and state["note"].startswith("saved at"), state
    ref = torch.load(reference)
    got = full_state(model, optim)
    assert set(got) == set(ref), set(got) ^ set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    # training continues after the load
    loss = model(torch.randn(4, 13)).pow(2).mean()
    loss.backward()
    optim.step()
    print(f"rank {rank}: fsdp2 load at {world} ok")


def save_replicated(path: str):
    """DDP-style: every rank holds the same 8 MiB; the checkpoint must hold it once."""
    torch.manual_seed(0)
    state = {"w": torch.randn(1024, 1024), "b": torch.randn(1024, 1024), "n": torch.randn(1000)}
    bcp.save(path, state)
    dist.barrier()
    if dist.get_rank() == 0:
        logical = sum(v.numel() * 4 for v in state.values())
        on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
                      if "/pack/" in os.path.join(d, f))
        meta = bcp.inspect(path)
        writers = meta.info["bytes_per_rank"]
        print(f"logical {logical} on_disk {on_disk} per_rank {writers}")
        assert logical <= on_disk <= logical + 64 * 64, (on_disk, logical)  # + 64-byte alignment of chunks
        assert max(writers) <= 1.1 * logical / 2 + 4000 * 4, writers


def prepare_fails_on_one_rank(path: str):
    """Rank 1's state cannot be flattened (two keys that print the same): every rank raises before
    anything is written, rank 0 naming rank 1; the next save on the same ranks works."""
    rank = dist.get_rank()
    good = {"w": torch.arange(8.0) + rank}
    bad = dict(good, d={1: torch.ones(2), "1": torch.zeros(2)}) if rank == 1 else good
    try:
        bcp.save(path, bad)
    except bcp.CheckpointError as exc:
        message = str(exc)
    else:
        raise AssertionError("the save did not fail")
    if rank == 0:
        assert "rank 1" in message and "appears twice" in message, message
    else:
        assert "appears twice" in message, message
    assert not os.path.exists(os.path.join(path, "metadata.json"))
    bcp.save(path, {"w": torch.arange(8.0)})  # the ranks' collectives are still in step
    out = {"w": torch.zeros(8)}
    bcp.load(path, out)
    assert torch.equal(out["w"], torch.arange(8.0))
    print(f"rank {rank}: prepare failure ok")
