"""Loading a stock PyTorch DCP checkpoint through bytecheckpoint vs dcp.load of the same checkpoint
(issue 45's target: <= 0.7x), real-model shapes, as a resume loads: into a fresh model and a fresh
AdamW (built untimed), warm (page cache) and cold (caches dropped before each timed load; root).

    python benchmarks/bench_dcp_read.py [--quick] [--blocks 24] [--repeats 3]
    python benchmarks/bench_dcp_read.py --convert [--blocks 96]   # leaving: convert vs copying the bytes

Checkpoints (written once by dcp.save of get_state_dict(model, optim), the stock way):
  1p    one process, plain model
  fsdp2 FSDP2 (fully_shard per block and root) on 2 gloo ranks
Rows: 1p -> 1p (same layout), fsdp2 -> fsdp2 on 2 ranks (same layout, max over ranks),
fsdp2 -> 1p (2 -> 1: dcp.load reshards into the plain model's state dict on one process).
bcp: bcp.load(path, {"model": model, "optim": optim}); DCP: get_state_dict -> dcp.load ->
set_state_dict. Each pair is checked equal once (weights and Adam moments) before timing.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_real_model import count_files, model_and_optim, process_group, timed  # noqa: E402
from figures import figure  # noqa: E402

import bytecheckpoint as bcp  # noqa: E402


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return True
    except OSError:
        return False


def load_bcp(path: str, blocks: int, fsdp: bool):
    model, optim = model_and_optim(blocks, fsdp=fsdp, trained=False)
    dt = timed(lambda: bcp.load(path, {"model": model, "optim": optim}))
    return dt, model, optim


def load_dcp(path: str, blocks: int, fsdp: bool):
    model, optim = model_and_optim(blocks, fsdp=fsdp, trained=False)

    def run():
        msd, osd = get_state_dict(model, optim)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return timed(run), model, optim


def full(model, optim) -> Dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    opts = StateDictOptions(full_state_dict=True)
    msd, osd = get_state_dict(model, optim, options=opts)
    out = {f"m/{k}": v for k, v in msd.items()}
    out.update({f"o/{n}/{k}": v for n, st in osd["state"].items() for k, v in st.items()})
    return out


def check_equal(a, b, what: str) -> None:
    fa, fb = full(*a), full(*b)
    bad = [k for k in fa if not torch.equal(fa[k], fb[k])]
    if set(fa) != set(fb) or bad:
        raise SystemExit(f"{what}: bcp and dcp loads differ: {bad[:3]} {set(fa) ^ set(fb)}")


def measure(path: str, blocks: int, fsdp: bool, repeats: int, cold: bool, what: str) -> Dict[str, float]:
    rank = dist.get_rank() if dist.is_initialized() else 0
    a, b = load_bcp(path, blocks, fsdp), load_dcp(path, blocks, fsdp)
    check_equal(a[1:], b[1:], what)
    times: Dict[str, List[float]] = {"bcp": [], "dcp": []}
    for _ in range(repeats):
        for name, fn in (("bcp", load_bcp), ("dcp", load_dcp)):
            if cold and rank == 0:
                drop_caches()
            if dist.is_initialized():
                dist.barrier()
            times[name].append(fn(path, blocks, fsdp)[0])
    return {k: statistics.median(v) for k, v in times.items()}


def save_fsdp2(rank: int, world: int, port: int, path: str, blocks: int) -> None:
    with process_group(rank, world, port):
        model, optim = model_and_optim(blocks, fsdp=True)
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def fsdp2_rows(rank: int, world: int, port: int, path: str, blocks: int, repeats: int, out: str) -> None:
    with process_group(rank, world, port):
        rows = {f"fsdp2 -> fsdp2 ({kind})": measure(path, blocks, True, repeats, kind == "cold", "fsdp2->fsdp2")
                for kind in ("warm", "cold")}
        if rank == 0:
            torch.save(rows, out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def convert_row(blocks: int, repeats: int = 3) -> None:
    """`convert --to dcp` of a real-model checkpoint vs copying its bytes (shutil.copytree), both
    after a warm read of the source and ending with os.sync(), alternated `repeats` times (the disk's
    write speed drifts with writeback: medians of the pairs); the conversion in-process (what the
    target measures) and once through the CLI (process start and imports included), with the
    converter's peak RSS (/usr/bin/time) above the imports alone."""
    import shutil
    import time
    from bytecheckpoint.tools.convert import convert
    root = tempfile.mkdtemp(prefix="bench_convert_")
    src = os.path.join(root, "ours")
    model, optim = model_and_optim(blocks)
    bcp.save(src, {"model": model, "optim": optim})
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    del model, optim
    files = [os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs]
    size = sum(os.path.getsize(f) for f in files)
    ck = bcp.default_checkpointer()
    copies, converts = [], []
    for _ in range(repeats):
        subprocess.run(["cat"] + files, stdout=subprocess.DEVNULL)
        os.sync()
        t0 = time.perf_counter()
        shutil.copytree(src, os.path.join(root, "copy"))
        os.sync()
        copies.append(time.perf_counter() - t0)
        shutil.rmtree(os.path.join(root, "copy"))
        os.sync()
        t0 = time.perf_counter()
        result = convert(ck.storage(src), ck.metadata(src), os.path.join(root, "dcp"), to="dcp")
        os.sync()
        converts.append(time.perf_counter() - t0)
        shutil.rmtree(os.path.join(root, "dcp"))
    copy_s, convert_s = statistics.median(copies), statistics.median(converts)
    os.sync()
    t0 = time.perf_counter()
    out = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "bytecheckpoint", "convert", src,
                          os.path.join(root, "dcp"), "--to", "dcp"], capture_output=True, text=True)
    os.sync()
    cli_s = time.perf_counter() - t0
    rss = next((int(line.split()[-1]) for line in out.stderr.splitlines() if "Maximum resident" in line), 0)
    base = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-c", "import bytecheckpoint, torch.distributed."
                           "checkpoint"], capture_output=True, text=True).stderr
    rss0 = next((int(line.split()[-1]) for line in base.splitlines() if "Maximum resident" in line), 0)
    print(f"convert --to dcp of {size / 2**20:.0f} MiB ({blocks} blocks, {result.tensors} tensors, "
          f"{result.values} values, {len(result.files)} files): {convert_s:.2f} s vs copying the bytes {copy_s:.2f} s "
          f"= {convert_s / copy_s:.2f}x (medians of {repeats}: convert {[round(x, 2) for x in converts]}, copy "
          f"{[round(x, 2) for x in copies]}); the CLI with process start and imports {cli_s:.2f} s; peak RSS "
          f"{rss / 1024:.0f} MiB, {(rss - rss0) / 1024:.0f} MiB above the imports alone; largest tensor "
          f"{largest / 2**20:.1f} MiB")
    figure(f"convert --to dcp, {size / 2**20:.0f} MiB", convert_s, copy_s, "<= 1.5x", peer_name="copytree")
    shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--convert", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--blocks", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    blocks, repeats = (4, 2) if a.quick else (a.blocks, a.repeats)
    torch.set_num_threads(1)
    if a.convert:
        return convert_row(blocks, a.repeats)
    root = tempfile.mkdtemp(prefix="bench_dcp_read_")
    one, sharded = os.path.join(root, "one"), os.path.join(root, "fsdp2")
    model, optim = model_and_optim(blocks)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=one)
    del model, optim, msd, osd
    mp.spawn(save_fsdp2, args=(2, free_port(), sharded, blocks), nprocs=2, join=True)
    rows: Dict[str, Dict[str, float]] = {}
    for kind in ("warm", "cold"):
        rows[f"1p -> 1p ({kind})"] = measure(one, blocks, False, repeats, kind == "cold", "1p->1p")
        rows[f"fsdp2 -> 1p ({kind})"] = measure(sharded, blocks, False, repeats, kind == "cold", "fsdp2->1p")
    result = os.path.join(root, "rows.pt")
    mp.spawn(fsdp2_rows, args=(2, free_port(), sharded, blocks, repeats, result), nprocs=2, join=True)
    rows.update(torch.load(result))
    info = bcp.inspect(one)
    print(f"model: {blocks} blocks, {len(info.tensors)} tensors, {info.nbytes / 2**20:.0f} MiB; files: 1p "
          f"{count_files(one)}, fsdp2 {count_files(sharded)}; cold = page cache dropped before each load"
          f"{'' if drop_caches() else ' (NOT possible here: cold rows are warm)'}; medians of {repeats}")
    print(f"{'load':28s} {'bcp s':>8s} {'dcp.load s':>10s} {'bcp/dcp':>8s}")
    for name, r in rows.items():
        ratio = r["bcp"] / r["dcp"]
        print(f"{name:28s} {r['bcp']:8.3f} {r['dcp']:10.3f} {ratio:8.2f}x")
        figure(f"DCP checkpoint load {name}", r["bcp"], r["dcp"], "<= 0.7", peer_name="dcp.load")


if __name__ == "__main__":
    main()
