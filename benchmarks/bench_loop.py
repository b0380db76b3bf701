"""What a checkpoint costs a training loop (issue 34): the run's time minus the same run without
saves, per save, beside the stall, for bytecheckpoint and its peers in one run. CPU, one process.

    python benchmarks/bench_loop.py [--quick] [--repeats 5] [--modes none,bcp,dcp_async,...]

An 8-layer MLP (width 1536, fp32) + AdamW: 72 MiB of parameters, 216 MiB of state with the two
moments; torch.set_num_threads(2); a save every --every steps (--steps timed steps after 3 warm-up
steps and one save). Each (mode, repeat) runs in a fresh process, the modes interleaved inside
every repeat (reversed every other one); medians over repeats, with the spread (min..max).

cost per save = (the run's time, including the final wait for the last save, - the median no-save
run's) / saves. Also: the stall (time inside the save call; for DCP's async staging plus the wait
on staging_completion before the step, torchtitan's placement), the extra process CPU per save
(process CPU - the no-save run's), the background CPU per GiB (bytecheckpoint's own count of its
job and worker threads, SaveHandle.stats["background_cpu_s"]) and the first save's stall (no
warm_up).

The machine may be shared: each child starts only when the 1-minute load average is below
--quiet-load (waiting up to --max-wait s), and a run during which other processes took more than
--max-foreign of the CPUs (from /proc/stat minus the child's own rusage) is dropped when at least
2 quiet runs of its mode remain. The table says how many runs each median has.

Modes:
  none                no saves (the reference)
  bcp_before          bytecheckpoint as it was before issue 34 (the tree of git ref --before, extracted)
  bcp_buffered        Checkpointer(async_save=True, async_staging=False, direct_io=False)
  bcp                 Checkpointer(async_save=True): the default options (on CPU: async_staging "auto"
                      = copied before save() returns; direct_io "auto" = O_DIRECT pack writes)
  bcp_staging         Checkpointer(async_save=True, async_staging=True)
  dcp_async           torch.distributed.checkpoint.async_save as documented (its default stager)
  dcp_async_staging   one reused DefaultStager(use_async_staging=True), staging_completion waited right
                      before optimizer.step (torchtitan's maybe_wait_for_staging)
  torch_save          torch.save of the state dicts on the training thread
  lightning_async     Lightning's AsyncCheckpointIO(TorchCheckpointIO)
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from figures import figure  # noqa: E402

MODES = ("none", "bcp_before", "bcp_buffered", "bcp", "bcp_staging", "dcp_async", "dcp_async_staging", "torch_save",
         "lightning_async")
# The measurement of this loop before the work (272 ms per save): the cost target is 0.5x
# of what bcp_before costs in the same run.
BEFORE_REF = "c0f08fe^"
GIB = float(1 << 30)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=72, help="timed steps")
    p.add_argument("--every", type=int, default=6, help="steps between saves")
    p.add_argument("--width", type=int, default=1536)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=96)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--before", default=BEFORE_REF, help="git ref of bytecheckpoint before issue 34 (bcp_before)")
    p.add_argument("--quick", action="store_true", help="2 repeats, 36 steps")
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=os.path.join(HERE, "out", "loop.json"))
    p.add_argument("--quiet-load", type=float, default=1.0)
    p.add_argument("--max-wait", type=float, default=600.0)
    p.add_argument("--max-foreign", type=float, default=0.10)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------- worker

def build(args):
    import torch
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), torch.randn(args.batch, args.width)


class Saver:
    """save(path) at a step boundary; before_step() right before optimizer.step; finish() at the end."""
    stall = 0.0

    def __init__(self, model, optim):
        self.model, self.optim = model, optim

    def before_step(self):
        pass

    def finish(self):
        pass

    def close(self):
        pass


class Bcp(Saver):
    def __init__(self, model, optim, **opts):
        super().__init__(model, optim)
        import bytecheckpoint as bcp
        self.ckpt = bcp.Checkpointer(async_save=True, **opts)
        self.handles = []

    def save(self, path):
        self.handles.append(self.ckpt.save(path, {"model": self.model, "optim": self.optim}))

    def finish(self):
        self.ckpt.wait()

    def reload(self, path):
        """A load of the newest checkpoint right after it was written (with O_DIRECT writes the page
        cache does not hold it: this is the price), into the live model and optimizer."""
        t = time.perf_counter()
        self.ckpt.load(path, {"model": self.model, "optim": self.optim})
        return time.perf_counter() - t

    def close(self):
        self.ckpt.close()


class DcpAsync(Saver):
    def __init__(self, model, optim, staging=False):
        super().__init__(model, optim)
        self.stager, self.future, self.staging = None, None, None
        if staging:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            self.stager = DefaultStager(StagingOptions(False, False, True, False))

    def save(self, path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        if self.future is not None:  # DCP's docs: wait for the previous save before the next one
            self.future.result()
        msd, osd = get_state_dict(self.model, self.optim)
        r = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=True, async_stager=self.stager)
        if hasattr(r, "staging_completion"):
            self.staging, self.future = r.staging_completion, r.upload_completion
        else:
            self.future = r

    def before_step(self):
        if self.staging is not None:
            t = time.perf_counter()
            self.staging.result()
            self.staging = None
            self.stall += time.perf_counter() - t

    def finish(self):
        if self.future is not None:
            self.future.result()

    def close(self):
        if self.stager is not None:
            self.stager.close()


class TorchSave(Saver):
    def save(self, path):
        import torch
        torch.save({"model": self.model.state_dict(), "optim": self.optim.state_dict()}, path + ".pt")


class LightningAsync(Saver):
    def __init__(self, model, optim):
        super().__init__(model, optim)
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
        self.io = AsyncCheckpointIO(TorchCheckpointIO())

    def save(self, path):
        self.io.save_checkpoint({"state_dict": self.model.state_dict(), "optimizer_states": [self.optim.state_dict()]},
                                path + ".ckpt")

    def finish(self):
        self.io.teardown()


def make_saver(mode, model, optim):
    bcp_opts = {"bcp_before": {}, "bcp_buffered": {"async_staging": False, "direct_io": False}, "bcp": {},
                "bcp_staging": {"async_staging": True}}
    if mode in bcp_opts:
        return Bcp(model, optim, **bcp_opts[mode])
    if mode.startswith("dcp_async"):
        return DcpAsync(model, optim, staging=mode == "dcp_async_staging")
    if mode == "torch_save":
        return TorchSave(model, optim)
    if mode == "lightning_async":
        return LightningAsync(model, optim)
    raise SystemExit(f"unknown mode {mode!r}")


def cpu_s():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def worker(args):
    import torch
    torch.set_num_threads(args.threads)
    model, optim, x = build(args)
    mode = args.worker
    saver = None if mode == "none" else make_saver(mode, model, optim)

    def step():
        model(x).square().mean().backward()
        if saver is not None:
            saver.before_step()
        optim.step()
        optim.zero_grad(set_to_none=True)

    for _ in range(3):  # the state exists (Adam's moments), then one save without warm_up (its stall reported)
        step()
    first = 0.0
    if saver is not None:
        t = time.perf_counter()
        saver.save(os.path.join(args.dir, "first"))
        first = time.perf_counter() - t
        step()
        saver.finish()
        saver.stall = 0.0
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        t.numel() * t.element_size() for s in optim.state.values() for t in s.values() if torch.is_tensor(t))
    n0 = len(getattr(saver, "handles", ()))
    saves, calls, steps, last = 0, [], [], None
    cpu0, t0 = cpu_s(), time.perf_counter()
    for i in range(args.steps):
        ts = time.perf_counter()
        step()
        if saver is not None and (i + 1) % args.every == 0:
            s0 = time.perf_counter()
            last = os.path.join(args.dir, f"step_{i + 1}")
            saver.save(last)
            calls.append(time.perf_counter() - s0)
            saves += 1
        steps.append(time.perf_counter() - ts)
    if saver is not None:
        saver.finish()
    run = time.perf_counter() - t0
    cpu = cpu_s() - cpu0
    out = dict(mode=mode, run_s=run, saves=saves, call_s=calls, staging_wait_s=saver.stall if saver else 0.0,
               cpu_s=cpu, first_stall_s=first, step_s=statistics.median(steps), state_bytes=state_bytes)
    stats = [dict(h.stats) for h in getattr(saver, "handles", ())[n0:]]
    if hasattr(saver, "reload") and last is not None:
        out["reload_s"] = saver.reload(last)
    if stats and "background_cpu_s" in stats[0]:
        out["bg_cpu_s"] = statistics.median(s["background_cpu_s"] for s in stats)
        out["fence_wait_s"] = statistics.median(s.get("fence_wait_s", 0.0) for s in stats)
    if saver is not None:
        saver.close()
    print("RESULT " + json.dumps(out), flush=True)


# ---------------------------------------------------------------------------------------- driver

def _busy_s():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def _wait_quiet(limit, max_wait):
    t = time.time()
    while time.time() - t < max_wait:
        with open("/proc/loadavg") as f:
            if float(f.read().split()[0]) < limit:
                return
        time.sleep(2)


def _before_tree(ref: str, base: str) -> str:
    """bytecheckpoint's tree at `ref`, extracted (import name bytecheckpoint -> its core/)."""
    where = os.path.join(base, "before")
    os.makedirs(where, exist_ok=True)
    archive = subprocess.run(["git", "-C", ROOT, "archive", ref, "core"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", where], input=archive, check=True)
    os.symlink("core", os.path.join(where, "bytecheckpoint"))
    return where


def run_child(args, mode, root, before):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--dir", root] + [
        f"--{k}={getattr(args, k)}" for k in ("steps", "every", "width", "layers", "batch", "threads")]
    env = dict(os.environ)
    if mode == "bcp_before":
        env["PYTHONPATH"] = before + os.pathsep + env.get("PYTHONPATH", "")
    _wait_quiet(args.quiet_load, args.max_wait)
    busy0, kids0, w0 = _busy_s(), resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime)
    foreign = max(0.0, _busy_s() - busy0 - own) / ((time.time() - w0) * (os.cpu_count() or 1))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            r["foreign"] = foreign
            return r
    sys.stderr.write(f"{mode} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}\n")
    return None


def main(argv=None):
    args = parse(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.repeats, args.steps = min(args.repeats, 2), min(args.steps, 36)
    modes = args.modes.split(",")
    modes = ["none"] + [m for m in modes if m != "none"]
    base = args.dir or tempfile.mkdtemp(prefix="bench_loop_")
    before = _before_tree(args.before, base) if "bcp_before" in modes else ""
    results = {m: [] for m in modes}
    for rep in range(args.repeats):
        for mode in (modes if rep % 2 == 0 else modes[::-1]):
            root = os.path.join(base, f"{mode}_{rep}")
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root)
            subprocess.run(["sync"])
            r = run_child(args, mode, root, before)
            shutil.rmtree(root, ignore_errors=True)
            if r is not None:
                r["rep"] = rep
                results[mode].append(r)
                print(f"rep {rep} {mode:18s} run {r['run_s']:6.2f}s cpu {r['cpu_s']:6.2f}s step "
                      f"{r['step_s'] * 1e3:4.0f}ms foreign {r['foreign']:.2f}", flush=True)
    report(args, modes, results)
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)


def report(args, modes, results):
    med = statistics.median
    for m in modes:
        quiet = [r for r in results[m] if r["foreign"] < args.max_foreign]
        if len(quiet) >= 2:
            results[m] = quiet
    if not results["none"]:
        raise SystemExit("the reference (no-save) runs failed")
    ref_run, ref_cpu = med(r["run_s"] for r in results["none"]), med(r["cpu_s"] for r in results["none"])
    gib = results["none"][0]["state_bytes"] / GIB
    print(f"\nstate {gib * 1024:.0f} MiB, step {med(r['step_s'] for r in results['none']) * 1e3:.0f} ms (no saves), "
          f"{args.steps} steps, a save every {args.every}; runs kept per mode: "
          + ", ".join(f"{m} {len(results[m])}" for m in modes))
    print(f"{'mode':18s} {'cost/save ms':>12s} {'(min..max)':>13s} {'stall ms':>8s} {'+wait ms':>8s} "
          f"{'CPU s/save':>10s} {'bg CPU s/GiB':>12s} {'fence ms':>8s} {'1st stall s':>11s} {'reload s':>8s}")
    table = {}
    for mode in modes[1:]:
        rs = results[mode]
        if not rs:
            continue
        n = rs[0]["saves"]
        costs = [(r["run_s"] - ref_run) / n * 1e3 for r in rs]
        row = dict(cost_ms=med(costs), min_ms=min(costs), max_ms=max(costs), runs=len(rs),
                   stall_ms=med(med(r["call_s"]) for r in rs) * 1e3,
                   wait_ms=med(r["staging_wait_s"] / n for r in rs) * 1e3,
                   cpu_s=med((r["cpu_s"] - ref_cpu) / n for r in rs),
                   bg_s_gib=med(r["bg_cpu_s"] for r in rs) / gib if "bg_cpu_s" in rs[0] else None,
                   fence_ms=med(r["fence_wait_s"] for r in rs) * 1e3 if "fence_wait_s" in rs[0] else None,
                   first_s=med(r["first_stall_s"] for r in rs),
                   reload_s=med(r["reload_s"] for r in rs) if "reload_s" in rs[0] else None)
        table[mode] = row
        bg = f"{row['bg_s_gib']:12.3f}" if row["bg_s_gib"] is not None else f"{'':>12s}"
        fence = f"{row['fence_ms']:8.1f}" if row["fence_ms"] is not None else f"{'':>8s}"
        reload = f"{row['reload_s']:8.3f}" if row["reload_s"] is not None else ""
        print(f"{mode:18s} {row['cost_ms']:12.0f} {row['min_ms']:6.0f}..{row['max_ms']:<6.0f} {row['stall_ms']:8.1f} "
              f"{row['wait_ms']:8.1f} {row['cpu_s']:10.3f} {bg} {fence} {row['first_s']:11.3f} {reload}")
    figures(table)
    if args.json:
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "worker"}, "table": table,
                       "raw": results}, f, indent=1)


def figures(table):
    before = table.get("bcp_before")
    peers = (("dcp_async", "DCP async_save"), ("dcp_async_staging", "DCP async_save + async staging"),
             ("torch_save", "torch.save"), ("lightning_async", "Lightning AsyncCheckpointIO"))
    for mode in ("bcp", "bcp_staging"):
        row = table.get(mode)
        if row is None:
            continue
        opts = "default options" if mode == "bcp" else "async_staging=True"
        if before is not None:
            figure(f"training cost per save, bcp {opts} vs bcp before issue 34 (CPU loop)", row["cost_ms"] / 1e3,
                   before["cost_ms"] / 1e3, "<= 0.5", peer_name="bcp before issue 34",
                   note=f"spread {row['min_ms']:.0f}..{row['max_ms']:.0f} vs {before['min_ms']:.0f}.."
                        f"{before['max_ms']:.0f} ms")
            figure(f"save stall, bcp {opts} vs bcp before issue 34", row["stall_ms"] / 1e3, before["stall_ms"] / 1e3,
                   "", peer_name="bcp before issue 34")
        for peer, name in peers:
            if peer in table:
                figure(f"training cost per save, bcp {opts} vs {name}", row["cost_ms"] / 1e3,
                       table[peer]["cost_ms"] / 1e3, "<= 1", peer_name=name)
        if row["bg_s_gib"] is not None:
            figure(f"background CPU per GiB saved, bcp {opts} (issue bound 0.5 s)", row["bg_s_gib"], 0.5, "<= 1",
                   unit="CPU-s/GiB", peer_name="the issue's bound",
                   note="bytecheckpoint's job + worker thread CPU (SaveHandle.stats['background_cpu_s'])")
        if before is not None:
            figure(f"extra process CPU per save, bcp {opts} vs bcp before issue 34", row["cpu_s"], before["cpu_s"],
                   "", unit="CPU-s", peer_name="bcp before issue 34")
            figure(f"first save's stall (no warm_up), bcp {opts} vs bcp before issue 34", row["first_s"],
                   before["first_s"], "", peer_name="bcp before issue 34")
    buffered = table.get("bcp_buffered")
    if buffered is not None and table.get("bcp") and table["bcp"]["reload_s"] and buffered["reload_s"]:
        figure("load right after the save (direct_io auto vs False: the page cache is not filled)",
               table["bcp"]["reload_s"], buffered["reload_s"], "", peer_name="the same load after buffered writes")


if __name__ == "__main__":
    main()
