"""A real model's shape: hundreds of tensors, many small (issue 21). Save and load of a Llama-shaped
model with AdamW state after one step, against DCP, torch.save + fsync and torch.load, same run.

    python benchmarks/bench_real_model.py [--quick] [--blocks 24] [--repeats 5]

State (built here, no download): embedding 32000 x 256, 24 blocks of q/k/v/o (256 x 256) and
gate/up (688 x 256) / down (256 x 688) weights and 2 norm vectors, final norm, head 32000 x 256:
219 parameters, with AdamW's exp_avg / exp_avg_sq / step: ~880 tensors, ~405 MiB.

Cases, each timed as the median of --repeats, interleaved (machine load hits all alike):
  1 process   bytecheckpoint save (sync) / load;  DCP save / load through get_state_dict /
              set_state_dict (its FileSystemWriter fsyncs);  torch.save + fsync, torch.load +
              load_state_dict. Loads go into a fresh model and a fresh AdamW, as a resume does (built
              untimed): DCP's get_state_dict runs a zero-lr step to make the optimizer's state,
              bytecheckpoint makes it from the checkpoint's keys
  FSDP2       2 gloo ranks, fully_shard per block and at the root; bytecheckpoint vs DCP (max over
              ranks)
  objects     files one save writes, divided by ranks, at --blocks and at 4x as many blocks
Loads are cold: before each one the page cache is dropped (`sync; echo 1 > /proc/sys/vm/drop_caches`,
root only; else they run warm and say so), as a resume after a failure reads (a new process, often
another node). Right after a save, a load would find the peers' buffered files in the page cache
and bytecheckpoint's O_DIRECT packs (storage/posix.py) only on the device: --warm measures that.
bench_steady.py measures a resume cold and warm, in new processes.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from figures import figure  # noqa: E402

DIM, FFN, VOCAB = 256, 688, 32000


class Block(nn.Module):
    def __init__(self, dim: int = DIM, ffn: int = FFN):
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        h = self.attn_norm(x)
        x = x + self.o(self.q(h) * torch.sigmoid(self.k(h)) + self.v(h))
        h = self.ffn_norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """Llama-shaped: embedding, `blocks` x (attention-like q/k/v/o + gated MLP + 2 norms), norm, head."""

    def __init__(self, blocks: int, dim: int = DIM, ffn: int = FFN, vocab: int = VOCAB):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, ffn) for _ in range(blocks))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def model_and_optim(blocks: int, fsdp: bool = False, trained: bool = True):
    """The model and its AdamW after one step (trained=False: fresh, as a resume builds them)."""
    torch.manual_seed(0 if trained else 1)
    model = Llama(blocks)
    if fsdp:
        from torch.distributed.fsdp import fully_shard
        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if trained:
        model(torch.randint(0, VOCAB, (2, 8))).float().pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def count_files(path: str) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def fresh(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    return path


def sync_all() -> None:
    if dist.is_initialized():
        dist.barrier()


def torch_save_fsynced(obj, path: str) -> None:
    """The durable torch.save peer: the file is fsynced before it counts as saved."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def drop_page_cache() -> bool:
    """A cold read: dirty pages written back, then the clean page cache dropped (root only)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return True
    except OSError:
        return False


# --warm (BCP_BENCH_WARM_LOADS=1, seen by the spawned ranks too) turns it off; so does a cache we cannot drop
COLD = {"loads": os.environ.get("BCP_BENCH_WARM_LOADS") != "1"}


def cold_note(warm: str = "") -> str:
    """A figure's note on how its loads read: cold (cold_start before each, every peer) or `warm`."""
    return "cold: page cache dropped before each load, every peer" if COLD["loads"] else warm


def cold_start() -> None:
    """Before a timed load: the page cache dropped (by rank 0 for the machine), every rank after it."""
    if COLD["loads"] and (not dist.is_initialized() or dist.get_rank() == 0):
        COLD["loads"] = drop_page_cache()
    sync_all()


def timed(fn: Callable[[], object]) -> float:
    sync_all()
    t0 = time.perf_counter()
    fn()
    sync_all()
    dt = time.perf_counter() - t0
    if dist.is_initialized():
        t = torch.tensor([dt], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dt = float(t.item())
    return dt


def run_case(root: str, blocks: int, repeats: int, fsdp: bool) -> Dict[str, List[float]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import bytecheckpoint as bcp

    model, optim = model_and_optim(blocks, fsdp)
    ckpt = bcp.Checkpointer()
    rank = dist.get_rank() if dist.is_initialized() else 0
    out: Dict[str, List[float]] = {k: [] for k in ("bcp_save", "dcp_save", "torch_save", "bcp_load", "dcp_load",
                                                   "torch_load", "bcp_files", "dcp_files")}

    def dcp_save(p):
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=p)

    def dcp_load(p, model, optim):  # a resume: get_state_dict makes the fresh optimizer's state (its step)
        msd, osd = get_state_dict(model, optim)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=p)
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    def torch_save(p):
        torch_save_fsynced({"model": model.state_dict(), "optim": optim.state_dict()}, p)

    def torch_load(p, model, optim):
        sd = torch.load(p, weights_only=True)
        model.load_state_dict(sd["model"])
        optim.load_state_dict(sd["optim"])

    for i in range(repeats):
        bp, dp, tp = f"{root}/bcp_{i}", f"{root}/dcp_{i}", f"{root}/torch_{i}.pt"
        if rank == 0:
            fresh(bp), fresh(dp)
        sync_all()
        out["bcp_save"].append(timed(lambda: ckpt.save(bp, {"model": model, "optim": optim})))
        out["dcp_save"].append(timed(lambda: dcp_save(dp)))
        if not fsdp:
            out["torch_save"].append(timed(lambda: torch_save(tp)))
        # loads as a resume does them: into a fresh model and a fresh optimizer (built untimed)
        m, o = model_and_optim(blocks, fsdp, trained=False)
        cold_start()
        out["bcp_load"].append(timed(lambda: ckpt.load(bp, {"model": m, "optim": o})))
        m, o = model_and_optim(blocks, fsdp, trained=False)
        cold_start()
        out["dcp_load"].append(timed(lambda: dcp_load(dp, m, o)))
        if not fsdp:
            m, o = model_and_optim(blocks, fsdp, trained=False)
            cold_start()
            out["torch_load"].append(timed(lambda: torch_load(tp, m, o)))
        del m, o
        if rank == 0:
            out["bcp_files"].append(count_files(bp))
            out["dcp_files"].append(count_files(dp))
        sync_all()
        if rank == 0:
            fresh(bp), fresh(dp)
            if os.path.exists(tp):
                os.remove(tp)
    ckpt.close()
    return out


def files_only(root: str, blocks: int) -> int:
    import bytecheckpoint as bcp
    model, optim = model_and_optim(blocks)
    p = fresh(f"{root}/files_{blocks}")
    bcp.save(p, {"model": model, "optim": optim})
    n = count_files(p)
    shutil.rmtree(p, ignore_errors=True)
    return n


@contextlib.contextmanager
def process_group(rank: int, world: int, port: int):
    """One spawned rank's gloo process group, destroyed on the way out."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fsdp_worker(rank: int, world: int, port: int, root: str, blocks: int, repeats: int, result: str) -> None:
    with process_group(rank, world, port):
        out = run_case(root, blocks, repeats, fsdp=True)
        if rank == 0:
            torch.save(out, result)


def ddp_worker(rank: int, world: int, port: int, root: str, blocks: int, repeats: int, result: str) -> None:
    """Fabric / Trainer DDP: every rank holds the whole (replicated) state. Rank 0 saves it alone (what
    the frameworks call, with ByteCheckpointIO or torch.save) against every rank writing its balanced
    share of the same bytes (the engine's dedup, process_group=None)."""
    import bytecheckpoint as bcp

    with process_group(rank, world, port):
        model, optim = model_and_optim(blocks)
        state = {"model": model.state_dict(), "optim": optim.state_dict()}
        ckpt = bcp.Checkpointer()
        out: Dict[str, List[float]] = {"rank0": [], "every": [], "torch": []}

        def torch_save(p):
            if rank == 0:
                torch_save_fsynced(state, p)

        for i in range(repeats):
            a, b, t = f"{root}/ddp_r0_{i}", f"{root}/ddp_all_{i}", f"{root}/ddp_{i}.pt"
            out["rank0"].append(timed(lambda: ckpt.save(a, state, process_group=bcp.LOCAL) if rank == 0 else None))
            out["every"].append(timed(lambda: ckpt.save(b, state)))
            out["torch"].append(timed(lambda: torch_save(t)))
            sync_all()
            if rank == 0:
                fresh(a), fresh(b)
                os.remove(t)
        ckpt.close()
        if rank == 0:
            torch.save(out, result)


def median(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=24)
    p.add_argument("--repeats", type=int, default=5)  # saves swing with the disk: medians of 5
    p.add_argument("--dir", default=None)
    p.add_argument("--quick", action="store_true", help="8 blocks, 2 repeats")
    p.add_argument("--warm", action="store_true", help="loads right after the save, page cache kept")
    args = p.parse_args()
    if args.warm:
        os.environ["BCP_BENCH_WARM_LOADS"] = "1"
        COLD["loads"] = False
    if args.quick or os.environ.get("BCP_BENCH_QUICK") == "1":
        args.blocks, args.repeats = 8, 2
    root = tempfile.mkdtemp(prefix="bcp-real-", dir=args.dir)
    try:
        model, optim = model_and_optim(args.blocks)
        n_tensors = len(model.state_dict()) + 3 * len(list(model.parameters()))
        mib = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3 / 2 ** 20
        print(f"state: {args.blocks} blocks, {len(list(model.parameters()))} parameters, ~{n_tensors} tensors with "
              f"AdamW, {mib:.0f} MiB", flush=True)
        del model, optim

        one = run_case(root, args.blocks, args.repeats, fsdp=False)
        print({k: [round(x, 3) for x in v] for k, v in one.items()}, flush=True)
        four = files_only(root, 4 * args.blocks)

        import torch.multiprocessing as mp
        from socket import socket
        with socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        result = os.path.join(root, "fsdp.pt")
        mp.spawn(fsdp_worker, args=(2, port, root, args.blocks, args.repeats, result), nprocs=2, join=True)
        two = torch.load(result)
        print({k: [round(x, 3) for x in v] for k, v in two.items()}, flush=True)

        result = os.path.join(root, "ddp.pt")
        mp.spawn(ddp_worker, args=(2, port + 1, root, args.blocks, args.repeats, result), nprocs=2, join=True)
        ddp = torch.load(result)
        print({k: [round(x, 3) for x in v] for k, v in ddp.items()}, flush=True)

        b = f"{args.blocks} blocks"
        loads = "cold" if COLD["loads"] else "warm"
        print(f"loads: {loads} ({'page cache dropped before each' if COLD['loads'] else 'right after the save'})",
              flush=True)
        figure(f"real model, 1 process: files per save ({b})", median(one["bcp_files"]), 8, "<= 1",
               unit="files", peer_name="target 8 per rank", note=f"DCP wrote {median(one['dcp_files']):.0f}")
        figure(f"real model, 1 process: files per save ({4 * args.blocks} blocks)", four, 8, "<= 1", unit="files",
               peer_name="target 8 per rank")
        figure(f"real model, FSDP2 2 ranks: files per save / ranks ({b})", median(two["bcp_files"]) / 2, 8, "<= 1",
               unit="files", peer_name="target 8 per rank", note=f"DCP wrote {median(two['dcp_files']):.0f}")
        figure(f"real model, 1 process: save vs DCP ({b})", median(one["bcp_save"]), median(one["dcp_save"]),
               "<= 0.8", peer_name="DCP save (fsync)")
        figure(f"real model, 1 process: save vs torch.save + fsync ({b})", median(one["bcp_save"]),
               median(one["torch_save"]), "<= 1.2", peer_name="torch.save + fsync")
        figure(f"real model, 1 process: resume {loads} (fresh model + AdamW) vs DCP ({b})", median(one["bcp_load"]),
               median(one["dcp_load"]), "<= 0.5", peer_name="DCP get_state_dict + load + set_state_dict")
        figure(f"real model, 1 process: resume {loads} (fresh model + AdamW) vs torch.load ({b})", median(one["bcp_load"]),
               median(one["torch_load"]), "<= 1.5", peer_name="torch.load + load_state_dict")
        figure(f"real model, FSDP2 2 ranks: save vs DCP ({b})", median(two["bcp_save"]), median(two["dcp_save"]),
               "<= 0.6", peer_name="DCP save (fsync)")
        figure(f"real model, DDP 2 ranks: every rank writes its share vs rank 0 alone ({b})", median(ddp["every"]),
               median(ddp["rank0"]), "", peer_name="rank 0 alone (what Fabric/Trainer DDP call)",
               note=f"torch.save + fsync on rank 0: {median(ddp['torch']):.3f} s")
        figure(f"real model, FSDP2 2 ranks: resume {loads} (fresh model + AdamW) vs DCP ({b})", median(two["bcp_load"]),
               median(two["dcp_load"]), "<= 0.5", peer_name="DCP get_state_dict + load + set_state_dict")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
