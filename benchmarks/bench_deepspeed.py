"""DeepSpeed ZeRO-2 / ZeRO-3 on 2 CPU processes (gloo): bytecheckpoint against DeepSpeed's own
checkpointing, same run (issue 23).

    DS_ACCELERATOR=cpu python benchmarks/bench_deepspeed.py [--quick] [--blocks 8] [--repeats 3]

Model: the Llama-shaped model of bench_real_model.py (--blocks blocks; 8 blocks: 75 parameters,
~260 MiB of fp32 master weights + Adam moments). Per stage, medians of --repeats, max over ranks:
  save       bcp.save(path, {"engine": engine}) (sync; fsyncs)  vs  engine.save_checkpoint (torch.save
             per rank, no fsync)
  stall      bcp async save: time until save() returns  vs  engine.save_checkpoint
  load       same world: bcp.load  vs  engine.load_checkpoint, each cold (page cache dropped first;
             BCP_BENCH_WARM_LOADS=1: as found)
  resume 1   one process: bcp.load into a 1-process engine  vs  DeepSpeed's way to change the world
             size: ds_to_universal (offline conversion, timed) + load_checkpoint with load_universal
  objects    files one save writes
"""
from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_real_model import Llama, cold_note, cold_start  # noqa: E402
from figures import figure  # noqa: E402


def _engine(stage: int, blocks: int, universal: bool = False):
    import deepspeed
    torch.manual_seed(0)
    model = Llama(blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10 ** 9}
    if universal:
        config["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    out = engine(torch.randint(0, 32000, (1, 8)))
    engine.backward(out.float().pow(2).mean())
    engine.step()
    return engine


def _init(rank: int, world: int, port: int) -> None:
    import deepspeed
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    t = torch.tensor([dt], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _count(path: str) -> int:
    return sum(len(fs) for _, _, fs in os.walk(path))


def two_ranks(rank: int, world: int, port: int, root: str, stage: int, blocks: int, repeats: int, result: str):
    import bytecheckpoint as bcp
    _init(rank, world, port)
    engine = _engine(stage, blocks)
    sync_ckpt, async_ckpt = bcp.Checkpointer(), bcp.Checkpointer(async_save=True)
    out = {k: [] for k in ("bcp_save", "ds_save", "bcp_stall", "bcp_load", "ds_load", "bcp_files", "ds_files")}
    for i in range(repeats):
        bp, dp, ap = f"{root}/bcp_{stage}_{i}", f"{root}/ds_{stage}_{i}", f"{root}/async_{stage}_{i}"
        out["bcp_save"].append(_timed(lambda: bcp.save(bp, {"engine": engine})))
        out["ds_save"].append(_timed(lambda: engine.save_checkpoint(dp, tag="t")))
        out["bcp_stall"].append(_timed(lambda: async_ckpt.save(ap, {"engine": engine})))
        async_ckpt.wait()
        cold_start()  # each load reads cold, as a resume in a new process does
        out["bcp_load"].append(_timed(lambda: sync_ckpt.load(bp, {"engine": engine})))
        cold_start()
        out["ds_load"].append(_timed(lambda: engine.load_checkpoint(dp, tag="t")))
        if rank == 0:
            out["bcp_files"].append(_count(bp))
            out["ds_files"].append(_count(dp))
    sync_ckpt.close()
    async_ckpt.close()
    if rank == 0:
        torch.save(out, result)
    dist.barrier()
    dist.destroy_process_group()


def one_rank(rank: int, world: int, port: int, root: str, stage: int, blocks: int, result: str, universal: str):
    import bytecheckpoint as bcp
    _init(rank, world, port)
    engine = _engine(stage, blocks)
    t0 = time.perf_counter()
    bcp.load(f"{root}/bcp_{stage}_0", {"engine": engine})
    bcp_s = time.perf_counter() - t0
    del engine
    theirs = _engine(stage, blocks, universal=True)
    t0 = time.perf_counter()
    theirs.load_checkpoint(universal, tag="t")
    ds_s = time.perf_counter() - t0
    torch.save({"bcp_resume": bcp_s, "ds_universal_load": ds_s}, result)
    dist.destroy_process_group()


def port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="2 blocks, 2 repeats")
    args = p.parse_args()
    if args.quick or os.environ.get("BCP_BENCH_QUICK") == "1":
        args.blocks, args.repeats = 2, 2
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        print("deepspeed is not installed (pip install 'bytecheckpoint[deepspeed]'): nothing measured")
        return
    root = tempfile.mkdtemp(prefix="bcp-ds-")
    try:
        for stage in (2, 3):
            res = os.path.join(root, f"two_{stage}.pt")
            mp.spawn(two_ranks, args=(2, port(), root, stage, args.blocks, args.repeats, res), nprocs=2, join=True)
            two = torch.load(res)
            universal = os.path.join(root, f"universal_{stage}")
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                            os.path.join(root, f"ds_{stage}_0", "t"), "--output_folder", os.path.join(universal, "t"),
                            "--inject_missing_state"], check=True, capture_output=True,
                           env=dict(os.environ, DS_ACCELERATOR="cpu"))
            convert_s = time.perf_counter() - t0
            with open(os.path.join(universal, "latest"), "w") as f:
                f.write("t")
            res1 = os.path.join(root, f"one_{stage}.pt")
            mp.spawn(one_rank, args=(1, port(), root, stage, args.blocks, res1, universal), nprocs=1, join=True)
            one = torch.load(res1)
            print(f"ZeRO-{stage}:", {k: [round(x, 3) for x in v] for k, v in two.items()},
                  f"convert {convert_s:.2f} s", one, flush=True)
            med = {k: statistics.median(v) for k, v in two.items()}
            z = f"DeepSpeed ZeRO-{stage}, 2 procs, {args.blocks} blocks"
            figure(f"{z}: sync save vs engine.save_checkpoint", med["bcp_save"], med["ds_save"], "<= 0.8",
                   peer_name="DeepSpeed save_checkpoint (no fsync; bcp fsyncs)")
            figure(f"{z}: async save stall vs engine.save_checkpoint", med["bcp_stall"], med["ds_save"], "<= 0.2",
                   peer_name="DeepSpeed save_checkpoint")
            figure(f"{z}: same-world load vs engine.load_checkpoint", med["bcp_load"], med["ds_load"], "<= 0.8",
                   peer_name="DeepSpeed load_checkpoint", note=cold_note())
            figure(f"{z}: resume on 1 process vs ds_to_universal + load_universal", one["bcp_resume"],
                   convert_s + one["ds_universal_load"], "<= 0.2",
                   peer_name="ds_to_universal (conversion) + universal load")
            figure(f"{z}: files per save / ranks", med["bcp_files"] / 2, 8, "<= 1", unit="files",
                   peer_name="target 8 per rank", note=f"DeepSpeed wrote {med['ds_files']:.0f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
