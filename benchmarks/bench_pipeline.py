"""Pipeline stages x FSDP2 (issue 38): save, async stall and resume on other layouts, against DCP with
its optimizer state flattened by name (the setting under which DCP reshards stages), same run.

    python benchmarks/bench_pipeline.py [--quick] [--blocks 24] [--repeats 3]

State: bench_real_model's Llama shape with its blocks in a ModuleDict (torchtitan's way: a stage is
a copy of the model with the other blocks deleted, names stay global), AdamW after one step.
Layout A: PP2 x FSDP2 on 4 gloo ranks (stage 0: embedding + the first half of the blocks; stage 1:
the rest + norm + head), fully_shard per block and per stage on the "dp" mesh dim.

  save          sync save, max over ranks: bytecheckpoint vs dcp.save (get_state_dict with
                flatten_optimizer_state_dict=True), medians of --repeats, interleaved
  async stall   what save() blocks the caller: bcp async_save vs dcp.async_save
  resume        into a fresh model and a fresh AdamW (built untimed): FSDP2 on 2 ranks (the whole
                model) and 1 process; bcp.load vs DCP get_state_dict + dcp.load + set_state_dict
  objects       files one save writes, per rank of layout A
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import time
from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_real_model import DIM, VOCAB, Block, count_files, median, process_group, timed  # noqa: E402
from figures import figure  # noqa: E402


class Llama(nn.Module):
    def __init__(self, blocks: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleDict({str(i): Block() for i in range(blocks)})
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for b in self.blocks.values():
            x = b(x)
        return self.head(self.norm(x)) if self.head is not None else x


def build(blocks: int, stage: int, stages: int, dp_mesh, trained: bool):
    """This rank's part (a stage, or the whole model with stages=1), FSDP2 on `dp_mesh` if given,
    and its AdamW (after one step when trained)."""
    torch.manual_seed(0 if trained else 1)
    model = Llama(blocks)
    per = blocks // stages
    owned = range(stage * per, blocks if stage == stages - 1 else (stage + 1) * per)
    for name in list(model.blocks):
        if int(name) not in owned:
            del model.blocks[name]
    if stage > 0:
        model.embed = None
    if stage < stages - 1:
        model.norm = model.head = None
    if dp_mesh is not None:
        from torch.distributed.fsdp import fully_shard
        for b in model.blocks.values():
            fully_shard(b, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if trained:
        x = torch.randint(0, VOCAB, (2, 8)) if stage == 0 else torch.randn(2, 8, DIM)
        model(x).float().pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def dcp_state(model, optim):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {"model": msd, "optim": osd}


def dcp_resume(path: str, model, optim) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    sd = dcp_state(model, optim)   # a fresh optimizer: DCP makes its state with a zero-lr step
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                   options=StateDictOptions(flatten_optimizer_state_dict=True))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_worker(rank: int, world: int, port: int, root: str, blocks: int, repeats: int, result: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import bytecheckpoint as bcp
    with process_group(rank, world, port):
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
        model, optim = build(blocks, mesh.get_local_rank("pp"), 2, mesh["dp"], trained=True)
        ckpt = bcp.Checkpointer()
        # DCP's async save runs its collectives on a background thread: on a group of its own (as
        # its docs advise), else they interleave with the training thread's on the default group
        async_group = dist.new_group(backend="gloo")
        out: Dict[str, List[float]] = {k: [] for k in ("bcp_save", "dcp_save", "bcp_stall", "bcp_async_total",
                                                       "dcp_stall", "dcp_async_total", "bcp_files", "dcp_files")}
        state = {"model": model, "optimizer": optim}
        for i in range(repeats + 1):   # the first round warms both up (plans, DCP's caches): not counted
            paths = {k: f"{root}/{k}_{i}" for k in ("bcp", "dcp", "bcp_async", "dcp_async")}
            t_bcp = timed(lambda: ckpt.save(paths["bcp"], state))
            t_dcp = timed(lambda: dcp.save(dcp_state(model, optim), checkpoint_id=paths["dcp"]))
            handle = {}
            t0 = time.perf_counter()
            stall = timed(lambda: handle.setdefault("h", ckpt.save(paths["bcp_async"], state, async_save=True)))
            handle["h"].wait()
            total = timed(lambda: None) + time.perf_counter() - t0
            t1 = time.perf_counter()
            dstall = timed(lambda: handle.setdefault("f", dcp.async_save(dcp_state(model, optim),
                                                                          checkpoint_id=paths["dcp_async"],
                                                                          process_group=async_group)))
            handle["f"].result()
            dtotal = timed(lambda: None) + time.perf_counter() - t1
            if rank == 0:
                print(f"round {i}: save {t_bcp:.3f} / {t_dcp:.3f} s, stall {stall:.3f} / {dstall:.3f} s; bcp async "
                      f"stats {({k: round(v, 4) for k, v in handle['h'].stats.items() if k.endswith('_s')})}",
                      flush=True)
            if i == 0:
                continue
            for k, v in (("bcp_save", t_bcp), ("dcp_save", t_dcp), ("bcp_stall", stall), ("bcp_async_total", total),
                         ("dcp_stall", dstall), ("dcp_async_total", dtotal)):
                out[k].append(v)
            if rank == 0 and i == 1:
                print("bytecheckpoint's files:", sorted(os.path.relpath(os.path.join(d, f), paths["bcp"])
                                                   for d, _, fs in os.walk(paths["bcp"]) for f in fs), flush=True)
            if rank == 0:
                out["bcp_files"].append(count_files(paths["bcp"]) / world)
                out["dcp_files"].append(count_files(paths["dcp"]) / world)
                for k in ("bcp_async", "dcp_async"):   # the resumes read the sync saves only
                    shutil.rmtree(paths[k], ignore_errors=True)
        ckpt.close()
        if rank == 0:
            torch.save(out, result)


def resume_worker(rank: int, world: int, port: int, root: str, blocks: int, repeats: int, result: str) -> None:
    """Resume layout B: FSDP2 over `world` ranks of the whole model (world > 1) or 1 process."""
    import contextlib

    import bytecheckpoint as bcp
    group = process_group(rank, world, port) if world > 1 else contextlib.nullcontext()
    with group:
        mesh = None
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", (world,))
        out: Dict[str, List[float]] = {"bcp_load": [], "dcp_load": []}
        for i in range(1, repeats + 1):
            m, o = build(blocks, 0, 1, mesh, trained=False)
            out["bcp_load"].append(timed(lambda: bcp.load(f"{root}/bcp_{i}", {"model": m, "optimizer": o})))
            m, o = build(blocks, 0, 1, mesh, trained=False)
            out["dcp_load"].append(timed(lambda: dcp_resume(f"{root}/dcp_{i}", m, o)))
            del m, o
        if rank == 0:
            torch.save(out, result)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None)
    p.add_argument("--quick", action="store_true", help="8 blocks, 2 repeats")
    args = p.parse_args()
    if args.quick or os.environ.get("BCP_BENCH_QUICK") == "1":
        args.blocks, args.repeats = 8, 2
    print(f"blocks {args.blocks}, repeats {args.repeats}", flush=True)
    root = tempfile.mkdtemp(prefix="bcp-pp-", dir=args.dir)
    import torch.multiprocessing as mp
    try:
        res = os.path.join(root, "save.pt")
        mp.spawn(save_worker, args=(4, _port(), root, args.blocks, args.repeats, res), nprocs=4, join=True)
        save = torch.load(res)
        print({k: [round(x, 3) for x in v] for k, v in save.items()}, flush=True)
        res = os.path.join(root, "fsdp2.pt")
        mp.spawn(resume_worker, args=(2, _port(), root, args.blocks, args.repeats, res), nprocs=2, join=True)
        fsdp2 = torch.load(res)
        res = os.path.join(root, "one.pt")
        resume_worker(0, 1, 0, root, args.blocks, args.repeats, res)
        one = torch.load(res)
        print({"fsdp2": fsdp2, "one": one}, flush=True)
        b = f"{args.blocks} blocks, PP2 x FSDP2"
        figure(f"pipeline: save vs DCP flattened ({b})", median(save["bcp_save"]), median(save["dcp_save"]), "<= 0.8",
               peer_name="dcp.save, flatten_optimizer_state_dict=True")
        figure(f"pipeline: async stall vs DCP async_save ({b})", median(save["bcp_stall"]), median(save["dcp_stall"]),
               "<= 0.3", peer_name="dcp.async_save",
               note=f"until committed: bcp {median(save['bcp_async_total']):.3f} s, "
                    f"DCP {median(save['dcp_async_total']):.3f} s")
        figure(f"pipeline: resume on FSDP2 2 ranks vs DCP ({b})", median(fsdp2["bcp_load"]), median(fsdp2["dcp_load"]),
               "<= 0.6", peer_name="DCP get_state_dict + load + set_state_dict")
        figure(f"pipeline: resume on 1 process vs DCP ({b})", median(one["bcp_load"]), median(one["dcp_load"]),
               "<= 0.6", peer_name="DCP get_state_dict + load + set_state_dict")
        figure(f"pipeline: files per rank per save ({b})", median(save["bcp_files"]), median(save["dcp_files"]), "",
               unit="files", peer_name="DCP")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
