"""Issue 32: what a mid-epoch resume on another process count does to the data stream, before
(the adapters' data order off: the frameworks' stock behaviour) and after, per framework, and what
the reshardable sampler costs.

    python benchmarks/bench_data_order.py [--out DIR] [--frameworks lightning,accelerate,trainer] [--quick]

A run on 2 processes (96 samples, global batch 12 = 6 x 2, 2 epochs of 8 steps; gloo on CPU)
saves at global step 3 (epoch 0) and 11 (epoch 1); it is resumed on 1 process (12 per process)
and on 3 (4 per process) from each. Reported per resume: the later global steps whose samples
differ from the uninterrupted 2-process run's, and the samples of the interrupted epoch trained
twice and never. Scripts: tests/integration/test_data_order_lightning.py (Lightning DDP +
ByteCheckpointIO(data_order=...)), tests/integration/accelerate_scripts/data_order.py (a
run_clm_no_trainer-style loop with skip_first_batches, or use_stateful_dataloader; both
use_seedable_sampler settings), tests/integration/transformers_scripts/data_ids.py (the Trainer:
its order is the stock one either way; "after" adds the line that names a shift).

The cost: one epoch of ElasticSampler against DistributedSampler (same output), FIGURE lines.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
INTEG = ROOT / "tests" / "integration"
sys.path[:0] = [str(HERE), str(ROOT)]
from figures import figure  # noqa: E402

N, G, PER_EPOCH = 96, 12, 8


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
    env.pop("LOCAL_RANK", None)
    return env


def _launch(cmd, env=None, timeout=300):
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env or _env(), capture_output=True, text=True, timeout=timeout,
                          start_new_session=True, cwd=str(INTEG))
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc.stdout + proc.stderr, time.perf_counter() - t0


def _torchrun(nproc, script, *args):
    return _launch([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                    "--max_restarts=0", "--monitor_interval=0.5", str(script), *args])


def _merge(paths):
    steps = collections.defaultdict(list)
    for p in paths:
        got = json.loads(Path(p).read_text())
        for k, ids in got["seen"].items():
            steps[int(k)] += ids
    return {k: sorted(v) for k, v in steps.items()}


def _counts(ref, got, stop, per_epoch=PER_EPOCH):
    """(later steps differing from ref, samples of the interrupted epoch trained twice, never)."""
    differ = sum(1 for k in got if got[k] != ref.get(k))
    e = stop // PER_EPOCH
    old = [i for k in range(e * PER_EPOCH, stop) for i in ref[k]]
    new = [i for k, v in got.items() if k < e * PER_EPOCH + per_epoch for i in v] if per_epoch else []
    c = collections.Counter(old + new)
    return differ, sum(v - 1 for v in c.values() if v > 1), N - len(c)


# ------------------------------------------------------------------------------------------ frameworks

def lightning(out, data_order, cases):
    script = INTEG / "test_data_order_lightning.py"
    flags = [] if data_order else ["--no-data-order"]
    tag = f"L{int(data_order)}"
    env = _env()

    def run(devices, *args):
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        e = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        return _launch([sys.executable, str(script), "--out", str(out), "--devices", str(devices), *args, *flags], e)

    run(2, "--tag", f"{tag}ref", "--save-at", "3", "11")
    ref = _merge([out / f"{tag}ref_rank{r}.json" for r in range(2)])
    rows = []
    for world, stop in cases:
        log, _ = run(world, "--tag", f"{tag}r{world}s{stop}", "--resume", str(out / f"{tag}ref_step{stop}.ckpt"))
        got = _merge([out / f"{tag}r{world}s{stop}_rank{r}.json" for r in range(world)])
        report = json.loads((out / f"{tag}r{world}s{stop}_rank0.json").read_text())["report"]
        rows.append(("Lightning DDP", "", world, stop, *_counts(ref, got, stop), report))
    return rows


def accelerate(out, data_order, cases, seedable, stateful):
    script = INTEG / "accelerate_scripts" / "data_order.py"
    flags = (["--seedable"] if seedable else []) + (["--stateful"] if stateful else []) + \
        ([] if data_order else ["--no-data-order"])
    tag = f"A{int(data_order)}{int(seedable)}{int(stateful)}"
    _torchrun(2, script, "--out", str(out), "--tag", f"{tag}ref", "--save-at", "3", "11", *flags)
    ref = _merge([out / f"{tag}ref.json"])
    rows = []
    for world, stop in cases:
        _torchrun(world, script, "--out", str(out), "--tag", f"{tag}r{world}s{stop}", "--resume",
                  str(out / f"{tag}ref_step_{stop}"), "--resume-step", str(stop), *flags)
        got = _merge([out / f"{tag}r{world}s{stop}.json"])
        report = json.loads((out / f"{tag}r{world}s{stop}.json").read_text())["report"]
        name = "Accelerate" + (" stateful loader" if stateful else " skip_first_batches")
        rows.append((name, f"use_seedable_sampler={seedable}", world, stop, *_counts(ref, got, stop),
                     "; ".join(report or [])))
    return rows


def trainer(out, cases):
    script = INTEG / "transformers_scripts" / "data_ids.py"

    def run(nproc, tag, batch, *args):
        _torchrun(nproc, script, "--out", str(out), "--tag", tag, "--batch", str(batch), *args)
        got = _merge([out / f"{tag}_rank{r}.json" for r in range(nproc)])
        return got, json.loads((out / f"{tag}_rank0.json").read_text())["report"]

    ref, _ = run(2, "Tref", 6, "--save-steps", "1")
    rows = []
    for world, batch, stop in cases:
        got, report = run(world, f"T{world}b{batch}s{stop}", batch, "--resume",
                          str(out / "Tref" / f"checkpoint-{stop}"))
        per_epoch = -(-N // (world * batch))
        counts = _counts(ref, got, stop, per_epoch=per_epoch if world * batch == G else None)
        if world * batch != G:  # the Trainer's own epoch: steps < per_epoch of the new global batch
            e0 = [i for k in range(stop) for i in ref[k]] + [i for k, v in got.items() if k < per_epoch for i in v]
            c = collections.Counter(e0)
            counts = ("n/a", sum(v - 1 for v in c.values() if v > 1), N - len(c))
        rows.append(("Trainer", f"global batch {G} -> {world * batch}", world, stop, *counts, report))
    return rows


# ------------------------------------------------------------------------------------------ the cost

def sampler_cost(n, world, repeats):
    from torch.utils.data.distributed import DistributedSampler

    from bytecheckpoint.data import ElasticSampler

    def epoch(cls):
        s = cls(range(n), num_replicas=world, rank=0, shuffle=True, seed=1)
        s.set_epoch(3)
        t0 = time.perf_counter()
        for _ in s:
            pass
        return time.perf_counter() - t0

    stock, ours = [], []
    for _ in range(repeats):
        stock.append(epoch(DistributedSampler))
        ours.append(epoch(ElasticSampler))
    figure(f"one epoch of the sampler, N={n}, {world} ranks (rank 0)", statistics.median(ours),
           statistics.median(stock), "<= 1.1", peer_name="DistributedSampler (same output)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--frameworks", default="lightning,accelerate,trainer")
    p.add_argument("--quick", action="store_true", help="2 -> 1 from step 3 only; Accelerate: the default sampler")
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_data_order_"))
    out.mkdir(parents=True, exist_ok=True)
    cases = [(1, 3)] if args.quick else [(1, 3), (3, 3), (1, 11), (3, 11)]
    rows = []
    t0 = time.perf_counter()
    for fw in args.frameworks.split(","):
        for data_order in (False, True):
            if fw == "lightning":
                rows += [(*r, "after" if data_order else "before") for r in lightning(out, data_order, cases)]
            elif fw == "accelerate":
                for stateful in ((False,) if args.quick else (False, True)):
                    for seedable in ((False,) if args.quick else (False, True)):
                        rows += [(*r, "after" if data_order else "before")
                                 for r in accelerate(out, data_order, cases, seedable, stateful)]
        if fw == "trainer":
            tcases = [(1, 12, 3), (1, 6, 3)] if args.quick else \
                [(1, 12, 3), (3, 4, 3), (1, 12, 11), (3, 4, 11), (1, 6, 3), (3, 6, 3)]
            rows += [(*r, "after") for r in trainer(out, tcases)]
    print(f"\nmid-epoch resume of a 2-process run (N={N}, global batch {G}, 2 epochs of {PER_EPOCH} steps; "
          f"{time.perf_counter() - t0:.0f} s)\n")
    print("| framework | setting | | 2 -> M | saved at step | later steps differing | interrupted epoch: trained "
          "twice | never | reported |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, setting, world, stop, differ, twice, never, report, when in rows:
        print(f"| {name} | {setting} | {when} | {world} | {stop} | {differ} | {twice} | {never} | {report or '-'} |")
    sampler_cost(200_000 if args.quick else 4_000_000, 8, 3 if args.quick else 5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
