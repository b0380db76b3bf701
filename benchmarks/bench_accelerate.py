"""Accelerate save_state / load_state: Accelerate's default files vs. attach(accelerator).

Same model, same optimizer state, same process count, same disk; four configurations, run in
turn within each repeat (interleaved, so machine load hits all of them alike):
  default    Accelerate's own writer (model.safetensors + optimizer.bin, the main process writes;
             no fsync) and reader (every process reads the files)
  bcp sync   attach(accelerator): the main process writes alone (process_group=LOCAL), with fsync;
             every process loads by itself
  bcp async  attach(accelerator, async_save=True): save_state returns after the copy-out
  bcp coll   attach(accelerator, collective_save=True): every process writes a balanced share

    .venv/bin/python benchmarks/bench_accelerate.py                 # 2 processes, ~256 MiB params
    .venv/bin/python benchmarks/bench_accelerate.py --nproc 1 --params-mib 64 --repeats 5

Prints a table of median seconds (max over ranks) and the ratio configuration / default (< 1 means
faster than Accelerate's default) next to the targets: load_state <= 0.8, sync save_state <= 1.3,
async save_state stall <= 0.2 of the default save. Every load reads cold (the page cache dropped
before it, every configuration), as a resume in a new process after a failure does; with
BCP_BENCH_WARM_LOADS=1 loads read what was just written as found (the default's files from the page
cache, bytecheckpoint's O_DIRECT packs from the device).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

CONFIGS = ("default", "bcp sync", "bcp async", "bcp coll")
ATTACH = {"bcp sync": {}, "bcp async": {"async_save": True}, "bcp coll": {"collective_save": True}}
# (row, config) -> target for config time / default time
TARGETS = {("save", "bcp sync"): 1.3, ("save", "bcp async"): 0.2, ("load", "bcp sync"): 0.8,
           ("load", "bcp async"): 0.8}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="processes (torchrun; 1 = plain python)")
    p.add_argument("--params-mib", type=float, default=256.0, help="fp32 parameter bytes (Adam adds 2x)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--quick", action="store_true", help="64 MiB of parameters (a smaller, faster run)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from accelerate import Accelerator
    from accelerate.utils import set_seed

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_real_model import cold_start
    import bytecheckpoint as bcp
    from accelerate_bytecheckpoint import attach

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    set_seed(0)
    layers = max(1, round(args.params_mib * 2**20 / 4 / (args.width * args.width + args.width)))
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = accelerator.prepare(model, opt)
    loss = model(torch.randn(2, args.width, device=accelerator.device)).square().mean()
    accelerator.backward(loss)
    opt.step()  # Adam moments exist
    opt.zero_grad()

    cpu: dict = {}

    def raw_write_fsync(rep: int) -> None:
        """The durable-write floor: the main process writes the same tensors to one file, fsync."""
        if not accelerator.is_main_process:
            return
        tensors = list(accelerator.unwrap_model(model).state_dict().values())
        tensors += [v for s in opt.optimizer.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)]
        target = os.path.join(args.dir, f"raw_{rep}.bin")
        with open(target, "wb") as f:
            for t in tensors:
                f.write(memoryview(t.detach().cpu().contiguous().numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        os.remove(target)

    def timed(fn, what: str = "") -> float:
        """Wall seconds, max over ranks; CPU seconds of this process (all its threads), summed over
        ranks, into cpu[what] (steadier than wall time on a machine shared with other jobs)."""
        accelerator.wait_for_everyone()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        both = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
        if dist.is_initialized():
            wall = both[:1].clone()
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            dist.all_reduce(both, op=dist.ReduceOp.SUM)
            both[0] = wall[0]
        cpu[what] = float(both[1])
        return float(both[0])

    # One engine per configuration for the whole run, as in training (a passed Checkpointer is not
    # closed by remove(): its staging pool stays allocated between saves).
    engines = {c: bcp.Checkpointer.from_env(async_save=ATTACH[c].get("async_save")) for c in CONFIGS[1:]}
    times: dict[str, dict[str, list[float]]] = {
        c: {"save": [], "commit": [], "load": [], "save_cpu": [], "load_cpu": []} for c in CONFIGS}
    sizes: dict[str, int] = {}
    for rep in range(-1, args.repeats):  # rep -1: warm-up round (first-touch of pools and files), not timed
        for config in CONFIGS:
            path = os.path.join(args.dir, f"{config.replace(' ', '_')}_{rep}")
            handle = None if config == "default" else attach(
                accelerator, engines[config], collective_save=ATTACH[config].get("collective_save", False))
            t_save = timed(lambda: accelerator.save_state(path), "save")
            t_commit = t_save + (timed(handle.wait, "wait") if handle is not None else 0.0)
            save_cpu = cpu["save"] + (cpu["wait"] if handle is not None else 0.0)
            if accelerator.is_main_process:
                sizes[config] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
            cold_start()
            t_load = timed(lambda: accelerator.load_state(path), "load")
            if handle is not None:
                handle.remove()
            if rep >= 0:
                times[config]["save"].append(t_save)
                times[config]["commit"].append(t_commit)
                times[config]["load"].append(t_load)
                times[config]["save_cpu"].append(save_cpu)
                times[config]["load_cpu"].append(cpu["load"])
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                shutil.rmtree(path)
        if rep >= 0:
            times.setdefault("raw fsync", {"save": []})["save"].append(timed(lambda: raw_write_fsync(rep), "raw"))
    if accelerator.is_main_process:
        n_params = sum(p.numel() for p in accelerator.unwrap_model(model).parameters())
        result = {
            "nproc": accelerator.num_processes,
            "params": n_params,
            "device": str(accelerator.device),
            "repeats": args.repeats,
            "median_s": {c: {k: statistics.median(v) for k, v in t.items()} for c, t in times.items()},
            "all_s": times,
            "bytes": sizes,
        }
        with open(args.result, "w") as f:
            json.dump(result, f)
    for engine in engines.values():
        engine.close()
    accelerator.end_training()


def table(result: dict) -> str:
    med = result["median_s"]
    rows = [
        ("save_state (blocking)", "save"),
        ("save_state until committed", "commit"),
        ("load_state", "load"),
        ("CPU-s: save until committed", "save_cpu"),
        ("CPU-s: load_state", "load_cpu"),
    ]
    bcp = CONFIGS[1:]
    head = (f"| {'operation':<28} | " + " | ".join(f"{c:>9}" for c in CONFIGS) + " | "
            + " | ".join(f"{c + '/def':>14}" for c in bcp) + " |")
    lines = [
        f"Accelerate save_state/load_state, {result['nproc']} process(es) on {result['device']}, "
        f"{result['params'] / 1e6:.1f}M fp32 params + AdamW state; median of {result['repeats']} (seconds, max over "
        "ranks); 'cfg/def' = cfg time / default time (< 1: faster than Accelerate's default), [target]",
        head,
        "|" + "|".join("-" * len(c) for c in head[1:-1].split("|")) + "|",
    ]
    for label, key in rows:
        base = med["default"][key]
        cells = " | ".join(f"{med[c][key]:>9.3f}" for c in CONFIGS)
        ratios = []
        for c in bcp:
            r = med[c][key] / base if base > 0 else float("nan")
            target = TARGETS.get((key, c))
            mark = "" if target is None else f" [{'ok' if r <= target else 'MISS'} <={target:g}]"
            ratios.append(f"{f'{r:.2f}{mark}':>14}")
        lines.append(f"| {label:<28} | {cells} | " + " | ".join(ratios) + " |")
    if "raw fsync" in med:
        lines.append(f"raw write+fsync of the same tensors by the main process (durable floor): "
                     f"{med['raw fsync']['save']:.3f} s; bcp sync / floor = "
                     f"{med['bcp sync']['save'] / med['raw fsync']['save']:.2f}")
    sizes = result["bytes"]
    lines.append(
        "checkpoint bytes on disk: " + ", ".join(f"{c}: {sizes.get(c, 0) / 2**20:.1f} MiB" for c in CONFIGS)
    )
    return "\n".join(lines)


def print_figures(result: dict) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_real_model import cold_note
    """FIGURE lines for benchmarks/run_all.py (benchmarks/figures.py)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from figures import figure

    med = result["median_s"]
    what = f"Accelerate DDP {result['nproc']} procs, {result['params'] / 1e6:.0f}M params + AdamW"
    default = "Accelerate's default save_state/load_state"
    figure(f"{what}: load_state", med["bcp sync"]["load"], med["default"]["load"], "<= 0.8", peer_name=default,
           note=cold_note("as found right after the save"))
    figure(f"{what}: sync save_state", med["bcp sync"]["save"], med["default"]["save"], "<= 1.3",
           peer_name=default + " (no fsync; bcp fsyncs)")
    figure(f"{what}: sync save_state", med["bcp sync"]["save"], med["raw fsync"]["save"], peer_name=(
        "raw write+fsync of the same bytes by the main process (the durable floor)"))
    figure(f"{what}: async save_state stall", med["bcp async"]["save"], med["default"]["save"], "<= 0.2",
           peer_name=default)
    figure(f"{what}: collective save_state (every process writes a share)", med["bcp coll"]["save"],
           med["default"]["save"], peer_name=default)


def main() -> int:
    args = parse()
    if args.quick:
        args.params_mib = min(args.params_mib, 64.0)
    if args.worker:
        worker(args)
        return 0
    root = args.dir or tempfile.mkdtemp(prefix="bench_accelerate_")
    os.makedirs(root, exist_ok=True)
    result_path = os.path.join(root, "result.json")
    script = os.path.abspath(__file__)
    forwarded = [
        "--worker", "--result", result_path, "--dir", root, "--params-mib", str(args.params_mib),
        "--width", str(args.width), "--repeats", str(args.repeats),
    ]  # fmt: skip
    if args.nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", script]
    else:
        cmd = [sys.executable, script]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        subprocess.run(cmd + forwarded, check=True, env=env)
        with open(result_path) as f:
            result = json.load(f)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(table(result))
    print_figures(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
