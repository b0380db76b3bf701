"""FSDP1 (FullyShardedDataParallel) scenarios on CPU gloo ranks.

One save run writes three checkpoints from 2 ranks after 3 AdamW steps: the flat route with
use_orig_params=True and False, and the ShardedTensor route (use_orig_params=True). Each load run
loads all three into one layout (FSDP1 at 3 ranks, FSDP2 at 2, a plain model on 1 process) and
compares model and optimizer state bit for bit with FSDP's own full state dict of the saving run.
Each checkpoint holds an LR scheduler too (its per-group lists are saved by parameter name).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor

import bytecheckpoint as bcp

CASES = {  # checkpoint name -> (route used to save, use_orig_params of the saving model)
    "flat_orig": ("flat", True),
    "flat_noorig": ("flat", False),
    "sharded_tensor": ("sharded_tensor", True),
}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 24)
        self.down = nn.Linear(24, 16)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 16))

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x))) * self.gain


class Net(nn.Module):
    """Root flat parameter of 224 + 119 elements: cut mid-row over 2 and 3 ranks. `out.weight` is
    tied to `emb.weight` (FSDP1 flattens it once; the state dict names it twice)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(13, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.emb = nn.Embedding(7, 16)
        self.out = nn.Linear(16, 7)
        self.out.weight = self.emb.weight
        self.register_buffer("scale", torch.arange(5.0))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x) * self.scale.sum()


def rank_world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def fsdp1(model: nn.Module, use_orig_params: bool, strategy: str = "FULL_SHARD") -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                use_orig_params=use_orig_params, sharding_strategy=getattr(ShardingStrategy, strategy))


def fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (rank_world()[1],))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build(kind: str, use_orig_params: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    model = Net()
    if kind == "fsdp1":
        model = fsdp1(model, use_orig_params)
    elif kind == "fsdp2":
        model = fsdp2(model)
    elif kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optim


def train(model, optim, steps: int, seed: int, sched=None):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(4, 13, generator=g)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        if sched is not None:
            sched.step()


def scheduler(optim):
    """lr 1e-2, halved every 2 steps: after 3 steps last_epoch 3, lr 5e-3."""
    return torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)


def full_state(model, optim):
    """Model and optimizer state as FSDP/DCP's full state dict gives it: name -> full tensor."""
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    out = {f"model/{k}": _full(v) for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim/{fqn}/{k}"] = _full(v)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]
    return out, groups


def _full(v):
    v = v.full_tensor() if isinstance(v, DTensor) else v
    return v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(v)


def save_all(root: str):
    """2 ranks: train, save each case, write FSDP's full state dict of the saving run as reference."""
    rank, _ = rank_world()
    for name, (route, orig) in CASES.items():
        model, optim = build("fsdp1", orig)
        sched = scheduler(optim)
        train(model, optim, 3, seed=rank, sched=sched)
        path = os.path.join(root, name)
        with bcp.Checkpointer(fsdp1_route=route) as ckpt:
            ckpt.save(path, {"model": model, "optim": optim, "sched": sched, "step": 3})
        ref = full_state(model, optim)
        # the structure (from rank 0) names every key, also state rank 0 holds none of
        tree = bcp.load_full(path)
        for k, v in ref[0].items():
            kind, rest = k.split("/", 1)
            if kind == "model":
                got = tree["model"][rest]
            else:
                fqn, stat = rest.rsplit("/", 1)
                got = tree["optim"]["state"][fqn][stat]
            assert torch.equal(got, v), (name, k)
        if rank == 0:
            torch.save(ref, os.path.join(root, name + ".ref.pt"))
            info = bcp.inspect(path)
            keys = {t.name for t in info.tensors}
            assert "model/scale" in keys and "model/scratch" not in keys, sorted(keys)
            assert "model/blocks.0.up.weight" in keys and "optim/state/out.bias/exp_avg" in keys, sorted(keys)
            assert "model/out.weight" in keys and "model/emb.weight" in keys, sorted(keys)
            logical = sum(t.nbytes for t in info.tensors)  # (the tied weight counts under both names)
            written = sum(info.info["bytes_per_rank"])
            # every byte written once, and neither rank writes much more than half
            assert written == logical, (name, written, logical)
            assert max(info.info["bytes_per_rank"]) <= 0.6 * logical, info.info["bytes_per_rank"]
    for strategy, orig in (("NO_SHARD", True), ("SHARD_GRAD_OP", False)):
        strategy_roundtrip(os.path.join(root, strategy), strategy, orig)
    for route in ("flat", "sharded_tensor"):
        fresh_optimizer_roundtrip(os.path.join(root, "fresh_" + route), route)
    refuse_storage_order(os.path.join(root, "refused"))
    print(f"rank {rank}: fsdp1 saves ok")


def fresh_optimizer_roundtrip(path: str, route: str):
    """An optimizer before its first step is saved without state and stays so (a checkpoint must not
    change training); loading it gives an optimizer without state and the saved hyperparameters.
    (use_orig_params=True: FSDP's own optimizer state dict refuses a state that names only some of a
    flat parameter's original parameters.)"""
    torch.manual_seed(0)
    model = fsdp1(Net(), use_orig_params=True)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with bcp.Checkpointer(fsdp1_route=route) as ckpt:
        ckpt.save(path, {"model": model, "optim": optim, "sched": scheduler(optim)})
    assert not optim.state
    ref = {k: v.full_tensor() if isinstance(v, DTensor) else v.clone()
           for k, v in get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))[0].items()}
    torch.manual_seed(5)
    model = fsdp1(Net(), use_orig_params=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1.0)
    sched = scheduler(optim)
    train(model, optim, 1, seed=0, sched=sched)
    with bcp.Checkpointer(fsdp1_route=route) as ckpt:
        ckpt.load(path, {"model": model, "optim": optim, "sched": sched})
    assert not optim.state and optim.param_groups[0]["lr"] == 3e-3 and sched.last_epoch == 0
    got = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))[0]
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)


def strategy_roundtrip(path: str, strategy: str, orig: bool):
    """Other sharding strategies: save and load back on the same ranks, bit-exact."""
    rank, _ = rank_world()
    torch.manual_seed(0)
    model = fsdp1(Net(), orig, strategy)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optim, 2, seed=rank)
    bcp.save(path, {"model": model, "optim": optim})
    ref, _ = full_state(model, optim)
    torch.manual_seed(5)
    model = fsdp1(Net(), orig, strategy)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    bcp.load(path, {"model": model, "optim": optim})
    got, _ = full_state(model, optim)
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref), strategy


class Transposed(nn.Module):
    """A parameter that is not contiguous when FSDP1 flattens it (stored in storage order)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 13).t())
        self.lin = nn.Linear(5, 3)

    def forward(self, x):
        return self.lin(x @ self.w)


def refuse_storage_order(path: str):
    """FSDP1 keeps a parameter that was not contiguous at wrap time in storage order: refused by name
    on every rank, nothing written."""
    torch.manual_seed(0)
    model = fsdp1(Transposed(), use_orig_params=True)
    try:
        bcp.save(path, {"model": model})
    except bcp.CheckpointError as exc:
        assert "'w'" in str(exc) and "contiguous" in str(exc), exc
    else:
        raise AssertionError("a storage-order FSDP1 parameter was saved")
    dist.barrier()
    assert not os.path.exists(path) or not any(fs for _, _, fs in os.walk(path))


def load_all(root: str, kinds: str):
    """Load every case into each of `kinds` (comma-separated: fsdp1 at any world size, fsdp2, ddp,
    plain) and compare bit for bit."""
    for kind in kinds.split(","):
        load_into(root, kind)


def load_into(root: str, kind: str):
    rank, world = rank_world()
    for i, name in enumerate(CASES):
        # FSDP1 targets alternate use_orig_params so that each checkpoint loads into the other flavour
        orig = bool(i % 2)
        model, optim = build(kind, orig, seed=1234)  # different initial values than the saved ones
        sched = scheduler(optim)
        with bcp.Checkpointer(fsdp1_route=CASES[name][0]) as ckpt:  # FSDP1 targets load through the route that saved
            state = ckpt.load(os.path.join(root, name), {"model": model, "optim": optim, "sched": sched, "step": 0})
        assert state["step"] == 3
        assert sched.last_epoch == 3 and sched.get_last_lr() == [5e-3], (name, sched.state_dict())
        ref, ref_groups = torch.load(os.path.join(root, name + ".ref.pt"))
        got, groups = full_state(model, optim)
        assert set(got) == set(ref), (name, sorted(set(got) ^ set(ref)))
        for k in ref:
            assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), (name, k, got[k], ref[k])
        assert groups == ref_groups, (groups, ref_groups)
        train(model, optim, 1, seed=99, sched=sched)  # training continues from the loaded state
        print(f"rank {rank}: {name} -> {kind} x{world} (use_orig_params={orig}) ok")
