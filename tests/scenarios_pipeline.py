"""Pipeline-parallel and expert-parallel layouts on gloo ranks (issue 38), run by launcher.py.

`train` runs torch.distributed.pipelining unpatched (PipelineStage with ScheduleGPipe,
Schedule1F1B or ScheduleInterleaved1F1B) on a (pp, dp, tp) mesh: FSDP2 on "dp", tensor parallel
on "tp"; stages are cut the way torchtitan cuts them (each rank deep-copies the whole model and
deletes what it does not own, so parameter names stay global). With pp=1 the same microbatches run
in a plain loop, accumulating gradients in the schedules' order. It trains steps [start, stop),
saves at `save_at` (the run goes on: it is the uninterrupted run), or starts from `load`, and writes
per rank: every step's microbatch losses, the samples each step trained on, and the final state.

The schedules run with scale_grads=False: by default they divide gradients by the number of
microbatches, which changes with the data-parallel degree; the loss is instead divided by the
global microbatch count and FSDP2 sums (gradient divide factor 1), so every layout computes the same
gradient (bit for bit where the data-parallel degree is unchanged).
"""
from __future__ import annotations

import copy
import json
import os
import time
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import bytecheckpoint as bcp

V, D, T = 64, 16, 6           # vocabulary, width, tokens per sample
N_SAMPLES, GLOBAL_BATCH, MICRO = 64, 8, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, h):
        return h + self.down(torch.tanh(self.up(h)))


class Tiny(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(layers)})
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, x):
        h = self.emb(x) if self.emb is not None else x
        for block in self.layers.values():
            h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.head(h) if self.head is not None else h


def whole_model(layers: int = 4) -> Tiny:
    torch.manual_seed(0)
    return Tiny(layers)


def cut(model: Tiny, owned, first: bool, last: bool) -> Tiny:
    """torchtitan's way (pipeline_module_split): a deep copy with the other layers deleted."""
    part = copy.deepcopy(model)
    for name in list(part.layers.keys()):
        if int(name) not in owned:
            del part.layers[name]
    if not first:
        part.emb = None
    if not last:
        part.norm = None
        part.head = None
    return part


def stage_layers(splits, stage):
    start = sum(splits[:stage])
    return range(start, start + splits[stage])


def make_optimizer(modules, kind: str):
    """Three groups by a name rule: decay, no decay (biases, norm), the embedding at its own lr.
    A stage holds the groups of its own parameters only."""
    named = [(n, p) for m in modules for n, p in m.named_parameters()]
    decay = [p for n, p in named if not n.startswith("emb.") and not (n.endswith("bias") or n.startswith("norm."))]
    no_decay = [p for n, p in named if not n.startswith("emb.") and (n.endswith("bias") or n.startswith("norm."))]
    emb = [p for n, p in named if n.startswith("emb.")]
    groups = [g for g in ({"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0},
                          {"params": emb, "weight_decay": 0.0, "lr": 3e-3}) if g["params"]]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    if kind == "adafactor":
        return torch.optim.Adafactor(groups, lr=1e-2)
    extra = {"adamw_foreach": {"foreach": True}, "adamw_fused": {"fused": True}}.get(kind, {"foreach": False})
    return torch.optim.AdamW(groups, lr=1e-2, **extra)


def sample(i: int):
    g = torch.Generator().manual_seed(1000 + int(i))
    t = torch.randint(V, (T + 1,), generator=g)
    return t[:-1], t[1:]


def _mesh(pp: int, dp: int, tp: int):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))


def _parallelize(part: Tiny, mesh, dp: int, tp: int) -> None:
    if tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        for block in part.layers.values():
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if dp > 1:
        from torch.distributed.fsdp import fully_shard
        for block in part.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(part, mesh=mesh["dp"])
        for m in part.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(1.0)          # sum: the loss is already divided
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def _full(t):
    from torch.distributed.tensor import DTensor
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def train(**args):
    pp, dp, tp = args.get("pp", 1), args.get("dp", 1), args.get("tp", 1)
    world = pp * dp * tp
    grouped = world > 1
    if grouped:  # launcher_worker made the group
        assert dist.get_world_size() == world, (dist.get_world_size(), world)
    mesh = _mesh(pp, dp, tp) if grouped else None
    pp_rank = mesh.get_local_rank("pp") if mesh is not None else 0
    dp_rank = mesh.get_local_rank("dp") if mesh is not None else 0
    splits = args.get("splits", [4])
    virtual = len(splits) // pp                      # stages per rank (interleaved: 2)
    stage_ids = [pp_rank + k * pp for k in range(virtual)]
    model = whole_model(sum(splits))
    parts = [cut(model, stage_layers(splits, s), s == 0, s == len(splits) - 1) for s in stage_ids]
    for part in parts:
        _parallelize(part, mesh, dp, tp)
    per_part = args.get("optimizer_per_part", False)
    kind = args.get("optimizer", "adamw")
    optims = [make_optimizer([p], kind) for p in parts] if per_part else [make_optimizer(parts, kind)]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1.0 + 0.1 * s)) for o in optims]
    loader = bcp.data.ElasticDataLoader(list(range(N_SAMPLES)), batch_size=GLOBAL_BATCH // dp, shuffle=True,
                                        seed=0, num_replicas=dp, rank=dp_rank)
    n_micro_local = GLOBAL_BATCH // dp // MICRO
    n_micro_global = GLOBAL_BATCH // MICRO

    def loss_fn(out, target):
        return F.cross_entropy(out.reshape(-1, V), target.reshape(-1)) / n_micro_global

    schedule = None
    if pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
        pp_group = mesh["pp"].get_group()
        stages = [PipelineStage(part, s, len(splits), torch.device("cpu"), group=pp_group)
                  for part, s in zip(parts, stage_ids)]
        kind_s = args.get("schedule", "gpipe")
        if kind_s == "interleaved":
            schedule = ScheduleInterleaved1F1B(stages, n_micro_local, loss_fn=loss_fn, scale_grads=False)
        else:
            klass = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind_s]
            schedule = klass(stages[0], n_micro_local, loss_fn=loss_fn, scale_grads=False)
    first, last = 0 in stage_ids, (len(splits) - 1) in stage_ids

    state = {"model": parts if len(parts) > 1 or args.get("parts_list") else parts[0],
             "optimizer": optims if per_part else optims[0],
             "lr_scheduler": scheds[0], "data": loader, "step": 0}
    if args.get("load"):
        bcp.load(args["load"], state, strict=True)
        print("data order:", loader.data_order)
    start = state["step"]
    out = {"losses": {}, "samples": {}}
    pending = []
    it = iter(loader)
    for step in range(start, args["stop"]):
        ids = next(it)
        x = torch.stack([sample(i)[0] for i in ids.tolist()])
        y = torch.stack([sample(i)[1] for i in ids.tolist()])
        losses = []
        if schedule is None:
            for i, (xm, ym) in enumerate(zip(x.chunk(n_micro_local), y.chunk(n_micro_local))):
                if dp > 1:  # reduce once, after the last microbatch, as PipelineStage does under FSDP2
                    parts[0].set_requires_gradient_sync(i == n_micro_local - 1)
                loss = loss_fn(parts[0](xm), ym)
                loss.backward()
                losses.append(loss.detach())
        else:
            kw = {}
            if last:
                kw.update(target=y, losses=losses)
            schedule.step(*((x,) if first else ()), **kw)
        for o in optims:
            o.step()
            o.zero_grad()
        for s in scheds:
            s.step()
        if last and (mesh is None or mesh.get_local_rank("tp") == 0):
            out["losses"][step] = [float(v) for v in losses]
        out["samples"][step] = ids.tolist()
        state["step"] = step + 1
        if args.get("save_at") == step + 1:
            bcp.save(args["save"], state)
        _save_step(args, state, step + 1, pending)
    _wait_saves(pending)
    out["dp_rank"] = dp_rank
    out["model"] = {n: _full(t) for part in parts for n, t in part.state_dict().items()}
    names = {id(p): n for part in parts for n, p in part.named_parameters()}
    out["optim"] = {names[id(p)]: {k: _full(v) if torch.is_tensor(v) else v for k, v in st.items()}
                    for o in optims for p, st in o.state.items()}
    out["groups"] = {names[id(p)]: {k: v for k, v in g.items() if k != "params"}
                     for o in optims for g in o.param_groups for p in g["params"]}
    rank = dist.get_rank() if grouped else 0
    torch.save(out, os.path.join(args["out"], f"rank{rank}.pt"))
    print("ok")


def _save_step(args, state, step: int, pending: list) -> None:
    """args["saves"] {step: path} (async with args["async_save"]); before the last of them, each rank
    marks `ready.<rank>` in args["marker_dir"] (the kill trials of tests/faults/test_kill_layouts.py
    kill a rank from then on)."""
    saves = {int(k): v for k, v in args.get("saves", {}).items()}
    if step not in saves:
        return
    if args.get("marker_dir") and step == max(saves):
        rank = dist.get_rank() if dist.is_initialized() else 0
        with open(os.path.join(args["marker_dir"], f".ready.{rank}"), "w") as f:
            f.write("ready")
        os.replace(os.path.join(args["marker_dir"], f".ready.{rank}"), os.path.join(args["marker_dir"], f"ready.{rank}"))
    pending.append((time.perf_counter(), bcp.save(saves[step], state, async_save=args.get("async_save", False))))


def _wait_saves(pending: list) -> None:
    """Wait for every save; print the last one's seconds from its start to its commit (SAVE_S)."""
    for t0, handle in pending:
        if handle is not None:
            handle.wait()
        print(f"SAVE_S {time.perf_counter() - t0:.3f}", flush=True)


# ---------------------------------------------------------------------- experts

E, H = 4, 8


class Experts(nn.Module):
    """Experts as one grouped parameter [E, ...] (torchtitan's GroupedExperts)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.router = nn.Linear(D, E)
        self.w1 = nn.Parameter(torch.randn(E, D, H) * 0.1)
        self.w2 = nn.Parameter(torch.randn(E, H, D) * 0.1)


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(D, H)
        self.w2 = nn.Linear(H, D)

    def forward(self, h):
        return self.w2(torch.relu(self.w1(h)))


class ExpertModules(nn.Module):
    """Experts as modules experts.<i>; rank r keeps the ones it owns (the others deleted)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.router = nn.Linear(D, E)
        self.experts = nn.ModuleDict({str(i): Expert() for i in range(E)})


def _fake_grads(module: nn.Module, step: int) -> None:
    """Gradients that depend on the parameter's global position only (any layout: the same)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    for name, p in module.named_parameters():
        shape = p.shape
        g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}".encode()))
        full = torch.randn(shape, generator=g)
        p.grad = distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full


def experts(**args):
    """Train 2 steps at expert-parallel degree `ep` (x FSDP2 `dp`), or load a checkpoint at that
    layout; write every expert's weights and AdamW moments as full tensors."""
    ep, dp = args.get("ep", 1), args.get("dp", 1)
    world = ep * dp
    rank = dist.get_rank() if world > 1 else 0
    if args["form"] == "grouped":
        model = Experts()
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Replicate, Shard, distribute_tensor
            mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))
            for name in ("w1", "w2"):
                full = getattr(model, name).detach()
                sharded = distribute_tensor(full, mesh["ep"], [Shard(0)])
                setattr(model, name, nn.Parameter(sharded))
            model.router.weight = nn.Parameter(distribute_tensor(model.router.weight.detach(), mesh["ep"], [Replicate()]))
            model.router.bias = nn.Parameter(distribute_tensor(model.router.bias.detach(), mesh["ep"], [Replicate()]))
            if dp > 1:
                from torch.distributed.fsdp import fully_shard
                fully_shard(model, mesh=mesh["dp"])
    else:
        model = ExpertModules()
        owned = [i for i in range(E) if i * world // E == rank]
        for name in list(model.experts.keys()):
            if int(name) not in owned:
                del model.experts[name]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    state = {"model": model, "optimizer": opt}
    if "stop" in args:  # steps [loaded step, stop) with args["saves"] (the kill trials)
        state["step"] = 0
        if args.get("load"):
            bcp.load(args["load"], state, strict=True)
        pending = []
        for step in range(state["step"], args["stop"]):
            _fake_grads(model, step)
            opt.step()
            state["step"] = step + 1
            _save_step(args, state, step + 1, pending)
        _wait_saves(pending)
    elif args.get("load"):
        bcp.load(args["load"], state, strict=args.get("strict", True))
    else:
        for step in range(2):
            _fake_grads(model, step)
            opt.step()
        group = bcp.LOCAL if args.get("alone") else None
        if not args.get("alone") or rank == 0:
            bcp.save(args["save"], state, process_group=group)
    names = {id(p): n for n, p in model.named_parameters()}
    out = {"model": {n: _full(t) for n, t in model.state_dict().items()},
           "optim": {names[id(p)]: {k: _full(v) for k, v in st.items()} for p, st in opt.state.items()}}
    torch.save(out, os.path.join(args["out"], f"rank{rank}.pt"))
    print("ok")


def merged_outputs(out_dir: str):
    """Every rank's output of a run: one dict of model / optimizer / groups by name, the losses of
    every step (microbatches of the data-parallel ranks in order) and the samples of every step."""
    model, optim, groups, losses, samples = {}, {}, {}, {}, {}
    for f in sorted(os.listdir(out_dir)):
        if not f.endswith(".pt"):
            continue
        o = torch.load(os.path.join(out_dir, f), weights_only=False)
        model.update(o["model"])
        optim.update(o["optim"])
        groups.update(o.get("groups", {}))
        for step, ls in o.get("losses", {}).items():
            losses.setdefault(step, {})[o.get("dp_rank", 0)] = ls
        for step, ids in o.get("samples", {}).items():
            samples.setdefault(step, {})[o.get("dp_rank", 0)] = ids
    losses = {s: [x for r in sorted(v) for x in v[r]] for s, v in losses.items()}
    samples = {s: sorted(x for r in sorted(v) for x in v[r]) for s, v in samples.items()}
    return {"model": model, "optim": optim, "groups": groups, "losses": losses, "samples": samples}


if __name__ == "__main__":  # a run by hand: python scenarios_pipeline.py '{"stop": 2, "out": "/tmp/x"}'
    import sys
    train(**json.loads(sys.argv[1]))


def conflicting_kinds(path):
    """Rank 0 saves `x` as a tensor, rank 1 as a plain value: refused on every rank, nothing committed."""
    rank = dist.get_rank()
    try:
        bcp.save(path, {"x": torch.ones(2) if rank == 0 else 3, "y": torch.zeros(1)})
    except bcp.ShardLayoutError as exc:
        print("refused:", exc)
    assert not os.path.exists(os.path.join(path, "metadata.json"))
