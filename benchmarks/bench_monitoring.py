"""What recording every save's and load's phases costs (issue 35: target < 1% of the operation).

    python benchmarks/bench_monitoring.py [--quick] [--reps N] [--dir /dev/shm/bcp-bench-monitoring]

One process, on tmpfs by default (the fastest storage, where a fixed cost weighs most). Two
states: an LLM-like one (bench_ranks.llm_like_state's shapes: 4096-wide fp32 params + two Adam moments) and
a Lightning-like one of 400 small tensors (per-tensor costs). For each: sync saves, async saves
(the stall and the whole save) and loads, with Checkpointer(record_stats="all") (the default)
against record_stats="off" (nothing recorded: the code of before), interleaved in every
repetition (the order alternates), medians.

Two measurements, both printed as FIGURE lines:
- recording cost, accounted (the judge, target <= 0.01): what recording adds to the operation:
  its spans x the cost of a span measured here (100k spans, best of 5), + the byte sums
  recording adds (timed on the same tensors), + a Recorder's life (made, attached, finished), +
  the record's own end (fold, JSON, put_aside; timed by the recorder: rec.self_s), over the
  operation's time with recording on. An async save's stall counts only what runs on the
  caller's thread before save() returns (its record is written on the job thread: counted in
  the whole async save).
- with / without recording (ratio of medians, no target): the A/B end to end. Its spread on a
  shared machine is larger than 1%; it shows that nothing else slowed down.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from typing import Dict, List

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from figures import figure  # noqa: E402

import bytecheckpoint as bcp  # noqa: E402
from bytecheckpoint.monitor import Recorder, SaveStats  # noqa: E402


def best_per_call(fn, n: int, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn(n)
        best = min(best, (time.perf_counter() - t) / n)
    return best


def span_cost() -> float:
    """Seconds per recorded span (the dearer of `with rec.span(...)` and `rec.add(...)`)."""
    def spans(n):
        rec = Recorder("save")
        for _ in range(n):
            with rec.span("write.pack", nbytes=1):
                pass

    def adds(n):
        rec, clock = Recorder("save"), time.perf_counter
        for _ in range(n):
            t0 = clock()
            rec.add("read.io", t0, clock(), 1, 1)

    def empty(n):
        for _ in range(n):
            pass
    base = best_per_call(empty, 100_000)
    return max(best_per_call(spans, 100_000), best_per_call(adds, 100_000)) - base


def fixed_cost() -> float:
    """Per operation: a Recorder made, attached to the handle's SaveStats, finished (its listener run)."""
    def lifecycle(n):
        for _ in range(n):
            rec = Recorder("save", rank=0, world_size=1, path="p")
            SaveStats().attach(rec)
            rec.finish()
    return best_per_call(lifecycle, 5_000)


def bytes_sum_cost(tensors: List[torch.Tensor]) -> float:
    """What recording adds per byte count of a save's sources (write, and async copy)."""
    return best_per_call(lambda n: [sum(t.numel() * t.element_size() for t in tensors) for _ in range(n)], 20)


def llm_like_state(mib: int) -> Dict[str, torch.Tensor]:
    """bench_ranks.llm_like_state's shapes as plain tensors (one process, no device mesh)."""
    width = 4096
    n_mats = max(1, (mib << 20) // 3 // (width * width * 4))
    rows = ((mib << 20) // 3 // n_mats) // (width * 4)
    g = torch.Generator().manual_seed(0)
    return {f"{part}.layers.{i}.{w}": torch.randn(*((rows, width) if w == "w" else (width,)), generator=g)
            for part in ("param", "exp_avg", "exp_avg_sq") for i in range(n_mats) for w in ("w", "norm")}


def small_state(n: int = 400) -> Dict[str, object]:
    g = torch.Generator().manual_seed(0)
    return {"state_dict": {f"model.layer.{i}.weight": torch.randn(128, 128, generator=g) for i in range(n // 2)},
            "optimizer": {f"state.{i}.exp_avg": torch.randn(128, 128, generator=g) for i in range(n // 2)},
            "epoch": 1, "global_step": 10}


def tensors_of(state) -> List[torch.Tensor]:
    out = []
    for v in state.values():
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            out += tensors_of(v)
    return out


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def run_case(name: str, state, root: str, reps: int, costs: Dict[str, float]) -> None:
    tensors = tensors_of(state)
    mib = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    sums = bytes_sum_cost(tensors)
    engines = {"on": bcp.Checkpointer(record_stats="all"), "off": bcp.Checkpointer(record_stats="off")}
    times: Dict[str, Dict[str, List[float]]] = {m: {"save": [], "stall": [], "async": [], "load": []} for m in engines}
    cost: Dict[str, List[float]] = {"save": [], "stall": [], "async": [], "load": []}
    ends: Dict[str, List[float]] = {"save": [], "async": [], "load": []}   # each record's own end (rec.self_s)
    for rep in range(reps + 1):                      # the first round warms caches and staging
        for mode in (("on", "off") if rep % 2 else ("off", "on")):
            ck = engines[mode]
            path = os.path.join(root, f"{mode}-{rep}")
            t = time.perf_counter()
            h = ck.save(path + "-s", state)
            t_save = time.perf_counter() - t
            t = time.perf_counter()
            a = ck.save(path + "-a", state, async_save=True)
            t_stall = time.perf_counter() - t
            a.wait()
            t_async = time.perf_counter() - t
            t = time.perf_counter()
            ck.load(path + "-s", state)
            t_load = time.perf_counter() - t
            for suffix in ("-s", "-a"):
                shutil.rmtree(path + suffix, ignore_errors=True)
            if rep == 0:
                continue
            for k, v in (("save", t_save), ("stall", t_stall), ("async", t_async), ("load", t_load)):
                times[mode][k].append(v)
            if mode == "on":
                srec, arec, lrec = h.stats._rec, a.stats._rec, ck.last_load_stats.rec
                fixed = costs["fixed"]
                cost["save"].append(len(srec._spans) * costs["span"] + sums + fixed + srec.self_s)
                caller = [s for s in arec._spans if s[2] <= arec.perf0 + a.stats["stall_s"]]
                cost["stall"].append(len(caller) * costs["span"] + sums + fixed)
                cost["async"].append(len(arec._spans) * costs["span"] + 2 * sums + fixed + arec.self_s)
                cost["load"].append(len(lrec._spans) * costs["span"] + fixed + lrec.self_s)
                for k, r in (("save", srec), ("async", arec), ("load", lrec)):
                    ends[k].append(r.self_s)
    for ck in engines.values():
        ck.close()
    label = f"{name} {mib:.0f} MiB"
    print(f"{label}: {len(tensors)} tensors; spans per sync save {len(srec._spans)}, async {len(arec._spans)}, "
          f"load {len(lrec._spans)}; byte sums {sums * 1e3:.3f} ms; record end (fold + JSON + put), median of "
          f"{reps}: {med(ends['save']) * 1e3:.3f} ms (sync save), {med(ends['async']) * 1e3:.3f} ms (async save, "
          f"job thread), {med(ends['load']) * 1e3:.3f} ms (load)", flush=True)
    for op, what in (("save", "sync save"), ("stall", "async save stall"), ("async", "async save (whole)"),
                     ("load", "load")):
        on = med(times["on"][op])
        figure(f"recording cost / {what}, {label}", med(cost[op]) * 1e3, on * 1e3, "<= 0.01", unit="ms",
               peer_name="the operation with recording (its median)",
               note=f"accounted: spans x {costs['span'] * 1e6:.2f} us + byte sums + recorder + record end; "
                    f"W=1, {root}")
    for op, what in (("save", "sync save"), ("stall", "async save stall"), ("load", "load")):
        on, off = times["on"][op], times["off"][op]
        spread = (max(off) - min(off)) / med(off) if off else float("nan")
        figure(f"{what} with / without recording, {label}", med(on) * 1e3, med(off) * 1e3, "", unit="ms",
               peer_name='record_stats="off"', note=f"A/B, {reps} interleaved reps; off spread {spread:.0%}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--dir", default="/dev/shm/bcp-bench-monitoring" if os.path.isdir("/dev/shm")
                    else "/tmp/bcp-bench-monitoring")
    args = ap.parse_args(argv)
    quick = args.quick or os.environ.get("BCP_BENCH_QUICK") == "1"
    reps = args.reps or (5 if quick else 11)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    costs = {"span": span_cost(), "fixed": fixed_cost()}
    print(f"span {costs['span'] * 1e6:.2f} us, per operation (recorder made, attached, finished) "
          f"{costs['fixed'] * 1e6:.2f} us; "
          f"{os.cpu_count()} CPUs", flush=True)
    try:
        run_case("LLM-like", llm_like_state(32 if quick else 256), args.dir, reps, costs)
        run_case("400 small tensors", small_state(), args.dir, reps, costs)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
