"""On a GPU (issue 26): the copy limit, async stalls, sync saves and loads into fresh GPU models,
against DCP and torch.save/torch.load, side by side in one run. Skipped without CUDA.

    python benchmarks/bench_gpu.py [--quick] [--sizes 2,8] [--dir DIR] [--shm DIR] [--sweep]

State: a Llama-shaped model (dim 1024, ffn 2816, vocab 32000), fp32 weights and AdamW moments
after one step, all on the GPU; `--sizes` in GiB picks the number of blocks (~2 GiB: 9 blocks,
~300 tensors; ~8 GiB: 48 blocks, ~1600 tensors). Measured, each the median of repeats:

  copy limit    raw D2H of every state tensor into pinned buffers (one arena, non-blocking copies,
                one synchronize), and H2D back: the floor of any stall / GPU load
  stall         bytecheckpoint async save: first save of a new engine, first save after
                Checkpointer.warm_up(state), and warm saves (2nd+); DCP async_save with its default
                stager and with DefaultStager(StagingOptions(use_pinned_memory=True, ...)), whose
                stall includes waiting for its staging (until then the state must not change); both
                include building the state dict (get_state_dict for DCP). Writes go to --shm.
  sync / load   (sizes <= 2 GiB, on --dir) bytecheckpoint sync save vs DCP save and torch.save +
                fsync; loads into a fresh GPU model and a fresh AdamW, the way a resume loads:
                bytecheckpoint, the same load into CPU tensors, DCP get_state_dict + load +
                set_state_dict, torch.load(map_location="cuda") + load_state_dict; warm (page cache
                holds the files) and cold (the files dropped from the page cache: posix_fadvise
                DONTNEED, plus drop_caches where allowed)
  --sweep       bytecheckpoint warm GPU load at io_threads 8/16 and pinned budgets 32/64/128 MiB (4 MiB slabs)
  loop          (issue 34; --no-loop skips it) a training loop with a save every 20 steps: no saves, the
                blocking copy (async_staging=False), async staging, DCP async_save with async staging
                waited before the step; the run time, the stall against the raw D2H copy (gpu_loop.py)
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_real_model import Llama  # noqa: E402
from figures import figure  # noqa: E402
from gpu_loop import run_loop  # noqa: E402

DIM, FFN, VOCAB = 1024, 2816, 32000
GiB = 1 << 30


def blocks_for(gib: float) -> int:
    per_block = 4 * DIM * DIM + 3 * DIM * FFN + 2 * DIM
    fixed = 2 * VOCAB * DIM + DIM
    return max(1, round((gib * GiB / 12 - fixed) / per_block))  # fp32 weight + 2 fp32 moments = 12 B


def fresh_model(blocks: int, device="cuda"):
    with torch.device(device):
        model = Llama(blocks, DIM, FFN, VOCAB)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def trained(blocks: int):
    torch.manual_seed(0)
    model, optim = fresh_model(blocks)
    model(torch.randint(0, VOCAB, (2, 16), device="cuda")).float().pow(2).mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return model, optim


def state_tensors(model, optim) -> List[torch.Tensor]:
    out = list(model.state_dict().values())
    for st in optim.state.values():
        out += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def median(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def timed(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------- copy limit

def copy_limit(tensors: List[torch.Tensor], repeats: int) -> Dict[str, float]:
    from bytecheckpoint.pipeline.staging import allocate
    bufs = allocate(tensors, pinned=True)
    d2h, h2d = [], []
    for _ in range(repeats):
        def down():
            for b, t in zip(bufs, tensors):
                b.copy_(t, non_blocking=True)
        def up():
            for b, t in zip(bufs, tensors):
                t.copy_(b, non_blocking=True)
        d2h.append(timed(down))
        h2d.append(timed(up))
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    big = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    one = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    single = median([timed(lambda: one.copy_(big.view(torch.uint8), non_blocking=True)) for _ in range(repeats)])
    del bufs, big, one
    gc.collect()
    return {"d2h": median(d2h), "h2d": median(h2d), "d2h_one_copy": single}


# ---------------------------------------------------------------------- stalls

def bcp_stalls(state, shm: str, repeats: int) -> Dict[str, object]:
    import bytecheckpoint as bcp
    out: Dict[str, object] = {}

    def one(ckpt, name):
        path = os.path.join(shm, name)
        torch.cuda.synchronize()
        h = ckpt.save(path, state)
        stats = dict(h.stats)
        h.wait()
        shutil.rmtree(path, ignore_errors=True)
        return stats

    with bcp.Checkpointer(async_save=True) as ckpt:
        out["first"] = one(ckpt, "first")["stall_s"]
    gc.collect()
    with bcp.Checkpointer(async_save=True) as ckpt:
        t0 = time.perf_counter()
        ckpt.warm_up(state)
        out["warm_up_call"] = time.perf_counter() - t0
        out["first_after_warm_up"] = one(ckpt, "after_warm_up")["stall_s"]
        warm = [one(ckpt, f"warm{i}") for i in range(repeats)]
        out["warm"] = median([s["stall_s"] for s in warm])
        out["warm_breakdown"] = {k: round(median([s[k] for s in warm]), 4) for k in warm[0] if k != "copies_started_early"}
        out["copies_started_early"] = all(s["copies_started_early"] for s in warm)
    gc.collect()
    return out


def dcp_stalls(model, optim, shm: str, repeats: int) -> Dict[str, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    out: Dict[str, float] = {}

    def run(name, stager):
        times = []
        for i in range(repeats):
            path = os.path.join(shm, f"dcp_{name}_{i}")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            msd, osd = get_state_dict(model, optim)
            kwargs = {"async_stager": stager} if stager is not None else {}
            resp = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path, **kwargs)
            staging = getattr(resp, "staging_completion", None)
            if staging is not None:
                staging.result()  # until then the state must not change
            times.append(time.perf_counter() - t0)
            upload = getattr(resp, "upload_completion", resp)
            upload.result()
            shutil.rmtree(path, ignore_errors=True)
        return times

    try:
        t = run("default", None)
        out["default_first"], out["default_warm"] = t[0], median(t[1:] or t)
    except Exception as exc:  # noqa: BLE001 - a peer's API of another torch: reported, not fatal
        print(f"DCP async_save (default) failed: {exc!r}", flush=True)
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    for name, options in (("pinned", dict(use_pinned_memory=True, use_shared_memory=False, use_async_staging=True,
                                          use_non_blocking_copy=True)),
                          ("pinned_sync_staging", dict(use_pinned_memory=True, use_shared_memory=False,
                                                       use_async_staging=False, use_non_blocking_copy=True))):
        try:
            stager = DefaultStager(StagingOptions(**options))
            try:
                t = run(name, stager)
            finally:
                stager.close()
            out[f"{name}_first"], out[f"{name}_warm"] = t[0], median(t[1:] or t)
            break
        except Exception:  # noqa: BLE001 - a peer's failure on this torch: reported, then the next variant
            import traceback
            print(f"DCP async_save with DefaultStager({options}) failed:\n{traceback.format_exc()[-1500:]}", flush=True)
    gc.collect()
    return out


# ---------------------------------------------------------------------- sync save and loads

def drop_cache(path: str) -> None:
    os.sync()
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    with contextlib.suppress(OSError):
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")


def torch_save_fsynced(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save_and_load(blocks: int, model, optim, root: str, repeats: int, sweep: bool) -> Dict[str, List[float]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import bytecheckpoint as bcp
    out: Dict[str, List[float]] = {}
    paths = {"bcp": f"{root}/bcp", "dcp": f"{root}/dcp", "torch": f"{root}/torch.pt"}

    def add(k, v):
        out.setdefault(k, []).append(v)

    def loads(kind: str):
        def bcp_into(device, **opts):
            m, o = fresh_model(blocks, device)
            with bcp.Checkpointer(**opts) as ck:
                t = timed(lambda: ck.load(paths["bcp"], {"model": m, "optim": o}))
                stats = ck.last_load_stats
            return t, stats

        def dcp_load():
            m, o = fresh_model(blocks)

            def go():
                msd, osd = get_state_dict(m, o)
                sd = {"model": msd, "optim": osd}
                dcp.load(sd, checkpoint_id=paths["dcp"])
                set_state_dict(m, o, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            return timed(go)

        def torch_load():
            m, o = fresh_model(blocks)

            def go():
                sd = torch.load(paths["torch"], map_location="cuda", weights_only=True)
                m.load_state_dict(sd["model"])
                o.load_state_dict(sd["optim"])
            return timed(go)

        for name, fn in (("bcp_gpu", lambda: bcp_into("cuda")), ("bcp_cpu", lambda: bcp_into("cpu")),
                         ("dcp", dcp_load), ("torch", torch_load)):
            if kind == "cold":
                drop_cache(root)
            r = fn()
            if isinstance(r, tuple):
                add(f"load_{kind}_{name}", r[0])
                if name == "bcp_gpu":
                    print(f"  {kind} bcp GPU load stats: {r[1]}", flush=True)
            else:
                add(f"load_{kind}_{name}", r)
            gc.collect()
        if sweep and kind == "warm":
            for threads in (8, 16):
                for budget in (32 << 20, 64 << 20, 128 << 20):
                    add(f"sweep_t{threads}_p{budget >> 20}", bcp_into("cuda", io_threads=threads,
                                                                      pinned_load_bytes=budget)[0])

    for i in range(repeats):
        for p in paths.values():
            if os.path.isdir(p):
                shutil.rmtree(p)
            elif os.path.exists(p):
                os.remove(p)
        with bcp.Checkpointer() as ck:
            add("save_bcp", timed(lambda: ck.save(paths["bcp"], {"model": model, "optim": optim})))

        def dcp_save():
            msd, osd = get_state_dict(model, optim)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=paths["dcp"])
        add("save_dcp", timed(dcp_save))
        add("save_torch", timed(lambda: torch_save_fsynced({"model": model.state_dict(),
                                                             "optim": optim.state_dict()}, paths["torch"])))
        loads("warm")
        loads("cold")
    return out


# ---------------------------------------------------------------------- main

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="2,8", help="GiB of state, comma-separated")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--dir", default=None, help="disk directory for sync saves and loads")
    p.add_argument("--shm", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                   help="directory for the async saves' writes (the stall does not depend on it)")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--json", default=None, help="write every measurement here")
    p.add_argument("--quick", action="store_true", help="0.5 GiB only, 2 repeats")
    p.add_argument("--no-loop", action="store_true", help="skip the training-loop measurement (issue 34)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device; skipped (the GPU figures are measured only where a GPU is present)")
        return
    if args.quick or os.environ.get("BCP_BENCH_QUICK") == "1":
        args.sizes, args.repeats = "0.5", 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    device = torch.cuda.get_device_name(0)
    print(f"device: {device}; torch {torch.__version__}; {os.cpu_count()} CPUs", flush=True)
    root = tempfile.mkdtemp(prefix="bcp-gpu-", dir=args.dir)
    shm = tempfile.mkdtemp(prefix="bcp-gpu-", dir=args.shm)
    everything = {"device": device, "torch": torch.__version__}
    try:
        for gib in [float(x) for x in args.sizes.split(",")]:
            blocks = blocks_for(gib)
            model, optim = trained(blocks)
            tensors = state_tensors(model, optim)
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            tag = f"{nbytes / GiB:.2f} GiB, {len(tensors)} tensors"
            print(f"\n== {tag} ({blocks} blocks)", flush=True)
            res: Dict[str, object] = {"bytes": nbytes, "tensors": len(tensors)}
            res["limit"] = copy_limit(tensors, max(3, args.repeats))
            print("copy limit", res["limit"], flush=True)
            where = shm if shutil.disk_usage(shm).free > 3 * nbytes else root  # a small /dev/shm: the disk
            res["bcp"] = bcp_stalls({"model": model, "optim": optim}, where, args.repeats)
            print("bcp stalls", res["bcp"], flush=True)
            res["dcp"] = dcp_stalls(model, optim, where, max(2, args.repeats - 1) if gib <= 2.5 else 2)
            print("dcp stalls", res["dcp"], flush=True)
            lim = res["limit"]["d2h"]
            b, d = res["bcp"], res["dcp"]
            figure(f"GPU async stall, warm ({tag}) vs raw D2H", b["warm"], lim, "<= 1.15" if gib <= 2 else "<= 1.1",
                   peer_name="raw D2H into pinned memory (copy limit)", note=device)
            figure(f"GPU async stall, first save after warm_up ({tag}) vs raw D2H", b["first_after_warm_up"], lim,
                   "<= 1.5", peer_name="raw D2H into pinned memory", note=f"{device}; without warm_up: {b['first']:.3f} s")
            if "default_warm" in d:
                figure(f"GPU async stall, warm ({tag}) vs DCP async_save", b["warm"], d["default_warm"], "",
                       peer_name="DCP async_save, default stager", note=device)
            for variant, label in (("pinned", "pinned, async staging"), ("pinned_sync_staging", "pinned")):
                if f"{variant}_warm" in d:
                    figure(f"GPU async stall, warm ({tag}) vs DCP async_save {variant} stager", b["warm"],
                           d[f"{variant}_warm"], "", peer_name=f"DCP async_save, DefaultStager({label})", note=device)
            if not args.no_loop:
                res["loop"] = lp = run_loop(model, optim, where, repeats=max(2, args.repeats - 1))
                print("loop", lp, flush=True)
                st, bl, no = lp["bcp_staging"], lp["bcp_blocking"], lp["none"]
                figure(f"GPU loop stall with async staging ({tag}) vs raw D2H", st["stall_s"], lim, "<= 0.1",
                       peer_name="raw D2H into pinned memory (copy limit)", note=device)
                figure(f"GPU loop run time, a save every 20 steps with async staging ({tag}) vs no saves", st["run_s"],
                       no["run_s"], "<= 1.02", peer_name="the same loop without saves", note=device)
                figure(f"GPU loop cost per save ({tag}): async staging vs the blocking copy", st["cost_per_save_s"],
                       bl["cost_per_save_s"], "", peer_name="async_staging=False", note=device)
                figure(f"GPU loop cost per save ({tag}): async staging vs DCP async staging", st["cost_per_save_s"],
                       lp["dcp_staging"]["cost_per_save_s"], "", peer_name="DCP async_save + DefaultStager(async "
                       "staging), waited before the step", note=device)
            if gib <= 2.5:
                res["io"] = io = save_and_load(blocks, model, optim, root, max(1, args.repeats // 2), args.sweep)
                print("save/load", {k: [round(x, 3) for x in v] for k, v in io.items()}, flush=True)
                m = {k: median(v) for k, v in io.items()}
                figure(f"GPU sync save ({tag}) vs DCP", m["save_bcp"], m["save_dcp"], "", peer_name="DCP save",
                       note=device)
                figure(f"GPU sync save ({tag}) vs torch.save + fsync", m["save_bcp"], m["save_torch"], "",
                       peer_name="torch.save + fsync", note=device)
                figure(f"GPU load warm ({tag}): speed into GPU vs into CPU", m["load_warm_bcp_cpu"],
                       m["load_warm_bcp_gpu"], ">= 0.9", peer_name="bcp load into GPU tensors (time)",
                       note=f"{device}; ratio = CPU time / GPU time (speed of the GPU load relative to the CPU one)")
                figure(f"GPU load warm ({tag}) vs DCP", m["load_warm_bcp_gpu"], m["load_warm_dcp"], "<= 0.6",
                       peer_name="DCP get_state_dict + load + set_state_dict", note=device)
                figure(f"GPU load warm ({tag}) vs torch.load", m["load_warm_bcp_gpu"], m["load_warm_torch"], "",
                       peer_name="torch.load(map_location=cuda) + load_state_dict", note=device)
                figure(f"GPU load warm ({tag}) vs raw H2D", m["load_warm_bcp_gpu"], res["limit"]["h2d"], "",
                       peer_name="raw H2D from pinned memory (copy limit)", note=device)
                figure(f"GPU load cold ({tag}): speed vs torch.load", m["load_cold_torch"], m["load_cold_bcp_gpu"],
                       ">= 0.95", peer_name="bcp cold load (time)",
                       note=f"{device}; ratio = torch.load time / bcp time; DCP cold {m['load_cold_dcp']:.3f} s")
            everything[f"{gib:g}GiB"] = res
            del model, optim, tensors
            gc.collect()
            torch.cuda.empty_cache()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(everything, f, indent=1, default=str)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
