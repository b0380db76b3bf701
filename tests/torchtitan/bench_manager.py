"""ByteCheckpointManager against torchtitan's own DCP manager in torchtitan's real Trainer (2 gloo
processes, FSDP2, llama3 debug model, CPU), every mode in one run:

    .venv/bin/python tests/torchtitan/bench_manager.py [--steps 12] [--interval 2] [--repeats 1]

Per configuration: the stall per save (seconds the loop spent in checkpointer.save, median over
saves, slowest rank), the loop's extra time per save (step + save time against the same run with
checkpointing off, divided by the saves), the resume (checkpointer.load on 2 processes), and the
files per rank of one checkpoint. A small model on a shared 2-core machine: read ratios, not
absolute numbers.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import launch  # noqa: E402

# DCP's async_with_pinned_mem is absent: it needs an accelerator (torch's DefaultStager: "Non-blocking
# copy requires that the current accelerator is available"), and these runs are CPU-only
CONFIGS = [("dcp", "disabled"), ("dcp", "async"), ("bcp", "disabled"), ("bcp", "async"),
           ("bcp", "async_with_pinned_mem")]


def _loop_s(records) -> float:
    return max(sum(r.get("step_s", [])) + sum(r.get("save_s", [])) for r in records)


def _files(path) -> int:
    return sum(len(files) for _, _, files in os.walk(path) if "stats" not in _)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--interval", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench_tt_")
    data = launch.make_dataset(os.path.join(root, "data"), documents=2000)
    base = dict(steps=args.steps, data_dir=data, interval=args.interval)
    rows = {}
    try:
        for rep in range(args.repeats):
            off = launch.run(2, dict(base, dump=os.path.join(root, f"off{rep}"), enable=False), timeout=600)
            for manager, mode in CONFIGS:
                dump = os.path.join(root, f"{manager}_{mode}_{rep}")
                recs = launch.run(2, dict(base, dump=dump, manager=manager, async_mode=mode), timeout=600)
                saves = [s for s in zip(*[r["save_s"] for r in recs])]
                stalls = [max(s) for s in saves if max(s) > 0]
                n_saves = args.steps // args.interval
                extra = (_loop_s(recs) - _loop_s(off)) / n_saves
                step_dir = os.path.join(dump, "checkpoint", f"step-{args.interval}")
                files = _files(step_dir) / 2
                resume = os.path.join(root, f"resume_{manager}_{mode}_{rep}")
                shutil.copytree(os.path.join(dump, "checkpoint", f"step-{args.steps}"),
                                os.path.join(resume, "checkpoint", f"step-{args.steps}"))
                res = launch.run(2, dict(base, dump=resume, manager=manager, async_mode=mode,
                                         steps=args.steps + 1), timeout=600)
                load = max(r["load_s"][0] for r in res)
                rows.setdefault((manager, mode), []).append((statistics.median(stalls), extra, load, files))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"| manager | async_mode | stall per save (s) | loop time per save (s) | resume (s) | files per rank |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (manager, mode), vals in rows.items():
        med = [statistics.median(v[i] for v in vals) for i in range(4)]
        name = "torchtitan DCP" if manager == "dcp" else "bytecheckpoint"
        print(f"| {name} | {mode} | {med[0]:.3f} | {med[1]:.3f} | {med[2]:.3f} | {med[3]:.0f} |")


if __name__ == "__main__":
    main()
