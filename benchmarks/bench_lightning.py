"""Lightning checkpointing, ByteCheckpointIO vs Lightning's own, side by side with ratios and targets:

1. Training-step stall per checkpoint (one process).
2. Resume load under DDP on 2 processes (--ddp-load): the time from the start of the checkpoint
   read to the end of the restore (Lightning's resume_start .. resume_end, slowest rank), for
   TorchCheckpointIO (every rank torch.loads the file) and ByteCheckpointIO (every rank reads
   alone; the weights straight into the module). Target: bcp / torch <= 0.8.

Same model (an MLP, Adam), same data, same disk, one process on CPU; four CheckpointIO plugins:
  torch       Lightning's default TorchCheckpointIO (torch.save on the training thread)
  torch async AsyncCheckpointIO(TorchCheckpointIO) (clones tensors, torch.save in a thread)
  bcp sync    ByteCheckpointIO()
  bcp async   ByteCheckpointIO(async_save=True)   (returns after the copy into staging buffers)
  bcp async staging  ByteCheckpointIO(async_save=True, async_staging=True) (issue 34: the optimizer's
              tensors copied behind the next forward/backward; its step waits for them)

A callback calls trainer.save_checkpoint every --every steps (to a new path each time) and
times the call: that is the stall the training loop sees. "overhead" is the whole fit's extra
wall time over the same fit without checkpoints, per checkpoint: it also counts background
writes competing with training for the CPU, waits for an earlier save, and the final wait in
teardown. Each configuration runs in a fresh process, --repeats times; medians are printed with
the ratio torch / configuration (> 1 means less stall than Lightning's default).

    .venv/bin/python benchmarks/bench_lightning.py                    # ~64 MiB params (+2x Adam)
    .venv/bin/python benchmarks/bench_lightning.py --params-mib 256 --repeats 5
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from figures import figure  # noqa: E402  (benchmarks/figures.py: the FIGURE lines run_all.py collects)

CONFIGS = ("torch", "torch async", "bcp sync", "bcp async", "bcp async staging")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params-mib", type=float, default=64.0, help="fp32 parameter bytes (Adam adds 2x)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--checkpoints", type=int, default=8, help="checkpoints per fit")
    p.add_argument("--every", type=int, default=3, help="training steps between checkpoints")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--skip-stall", action="store_true", help="only the DDP resume-load comparison")
    p.add_argument("--skip-ddp-load", action="store_true", help="only the stall comparison")
    p.add_argument("--quick", action="store_true", help="16 MiB of parameters, 2 repeats (a smaller, faster run)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--make-ckpt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ddp-load", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


LOAD_CONFIGS = ("torch", "bcp")


def _mlp_class(args: argparse.Namespace):
    import lightning.pytorch as pl
    import torch

    layers = max(1, round(args.params_mib * 2**20 / 4 / (args.width * args.width + args.width)))

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(layers)])

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    return MLP, layers


def _load_plugin(config: str):
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from lightning_bytecheckpoint import ByteCheckpointIO

    return TorchCheckpointIO() if config == "torch" else ByteCheckpointIO()


def make_checkpoint(args: argparse.Namespace) -> dict:
    """One process: 2 training steps (Adam state exists), then a checkpoint through the plugin."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    MLP, layers = _mlp_class(args)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, plugins=[_load_plugin(args.worker)])
    trainer.fit(MLP(), DataLoader(TensorDataset(torch.randn(args.batch * 2, args.width)), batch_size=args.batch))
    trainer.save_checkpoint(args.make_ckpt)
    trainer.strategy.checkpoint_io.teardown()
    return {"layers": layers}


def ddp_load(args: argparse.Namespace) -> None:
    """2-process DDP resume from args.ddp_load; each rank writes its restore time next to it."""
    import time as _time

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
    from torch.utils.data import DataLoader, TensorDataset

    times: dict = {}
    start, end = _CheckpointConnector.resume_start, _CheckpointConnector.resume_end

    def timed_start(self, *a, **k):  # benchmark instrumentation only
        times.setdefault("t0", _time.perf_counter())
        return start(self, *a, **k)

    def timed_end(self, *a, **k):
        out = end(self, *a, **k)
        times["t1"] = _time.perf_counter()
        return out

    _CheckpointConnector.resume_start, _CheckpointConnector.resume_end = timed_start, timed_end
    torch.set_num_threads(1)
    MLP, _ = _mlp_class(args)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         plugins=[_load_plugin(args.worker)])
    trainer.fit(MLP(), DataLoader(TensorDataset(torch.randn(args.batch * 4, args.width)), batch_size=args.batch),
                ckpt_path=args.ddp_load)
    assert trainer.global_step == 2  # restored, nothing left to train
    with open(f"{args.ddp_load}.rank{trainer.global_rank}.time", "w") as f:
        f.write(str(times["t1"] - times["t0"]))
    trainer.strategy.barrier()  # both ranks' files exist before either leaves
    # gloo's teardown at interpreter exit sometimes aborts ("terminate called without an active
    # exception"), for either plugin; the measurement is written, so leave without it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker(args: argparse.Namespace) -> dict:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_bytecheckpoint import ByteCheckpointIO

    plugins = {
        "torch": lambda: TorchCheckpointIO(),
        "torch async": lambda: AsyncCheckpointIO(TorchCheckpointIO()),
        "bcp sync": lambda: ByteCheckpointIO(),
        "bcp async": lambda: ByteCheckpointIO(async_save=True),
        "bcp async staging": lambda: ByteCheckpointIO(async_save=True, async_staging=True),
    }
    MLP, layers = _mlp_class(args)

    class SaveEvery(pl.Callback):
        def __init__(self, folder: str | None) -> None:
            self.folder, self.stalls = folder, []

        def on_train_batch_end(self, trainer, *_):
            if self.folder and trainer.global_step % args.every == 0:
                t0 = time.perf_counter()
                trainer.save_checkpoint(os.path.join(self.folder, f"step={trainer.global_step}.ckpt"))
                self.stalls.append(time.perf_counter() - t0)

    steps = args.every * args.checkpoints + 2  # +2: the last save overlaps some training too
    data = TensorDataset(torch.randn(args.batch * steps, args.width))

    def fit(folder: str | None) -> tuple[float, list[float]]:
        pl.seed_everything(0, verbose=False)
        cb = SaveEvery(folder)
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
            plugins=[plugins[args.worker]()] if folder else None,
        )
        t0 = time.perf_counter()
        trainer.fit(MLP(), DataLoader(data, batch_size=args.batch))  # includes teardown's final wait
        return time.perf_counter() - t0, cb.stalls

    fit(None)  # warm-up: allocator, kernels, page cache
    base, _ = fit(None)
    folder = tempfile.mkdtemp(dir=args.dir)
    try:
        total, stalls = fit(folder)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"stall_s": statistics.median(stalls), "stalls": stalls, "first_s": stalls[0],
            "overhead_s": (total - base) / len(stalls),
            "step_s": base / steps, "ckpt_mib": size / len(stalls) / 2**20, "layers": layers}


def main() -> None:
    args = parse()
    if args.worker and args.make_ckpt:
        print("RESULT " + json.dumps(make_checkpoint(args)))
        return
    if args.worker and args.ddp_load:
        ddp_load(args)
        return
    if args.worker:
        print("RESULT " + json.dumps(worker(args)))
        return
    if args.quick:
        args.params_mib, args.repeats = min(args.params_mib, 16.0), min(args.repeats, 2)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if not args.skip_stall:
        stall_table(args, env)
    if not args.skip_ddp_load:
        load_table(args, env)


def _run(cmd: list, env: dict, what: str) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode:
        sys.exit(f"{what} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def load_table(args: argparse.Namespace, env: dict) -> None:
    folder = tempfile.mkdtemp(dir=args.dir)
    times: dict[str, list[float]] = {c: [] for c in LOAD_CONFIGS}
    try:
        paths = {}
        for config in LOAD_CONFIGS:
            paths[config] = os.path.join(folder, f"{config}.ckpt")
            _run([sys.executable, __file__, "--worker", config, "--make-ckpt", paths[config]] + _forward(args),
                 env, f"{config} checkpoint")
        for r in range(args.repeats):
            for config in LOAD_CONFIGS:  # interleaved
                ddp_env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
                ddp_env.pop("LOCAL_RANK", None)
                _run([sys.executable, __file__, "--worker", config, "--ddp-load", paths[config]] + _forward(args),
                     ddp_env, f"{config} DDP resume")
                ranks = [float(open(f"{paths[config]}.rank{i}.time").read()) for i in range(2)]
                times[config].append(max(ranks))
                print(f"  repeat {r + 1}/{args.repeats} {config:6s} DDP resume load {times[config][-1]:.3f}s",
                      file=sys.stderr)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    med = {c: statistics.median(times[c]) for c in LOAD_CONFIGS}
    print(f"\nLightning DDP resume load, 2 CPU processes, ~{args.params_mib:.0f} MiB fp32 params + Adam, slowest rank,"
          f" median of {args.repeats} interleaved runs\n")
    print("| plugin | load s | ratio to torch | target |")
    print("|---|---:|---:|---:|")
    print(f"| TorchCheckpointIO | {med['torch']:.3f} | 1.00 | |")
    ratio = med["bcp"] / med["torch"]
    print(f"| ByteCheckpointIO | {med['bcp']:.3f} | {ratio:.2f} | <= 0.8 ({'met' if ratio <= 0.8 else 'MISSED'}) |")
    figure(f"Lightning DDP 2 procs: resume load (~{args.params_mib:.0f} MiB params + Adam)", med["bcp"], med["torch"],
           "<= 0.8", peer_name="TorchCheckpointIO (every rank torch.loads the file)")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stall_table(args: argparse.Namespace, env: dict) -> None:
    results: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    for r in range(args.repeats):
        for config in CONFIGS:  # interleaved, so drifting machine load hits all alike
            cmd = [sys.executable, __file__, "--worker", config] + _forward(args)
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if out.returncode or not line:
                sys.exit(f"{config} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
            results[config].append(json.loads(line[0][7:]))
            print(f"  repeat {r + 1}/{args.repeats} {config:12s} stall {results[config][-1]['stall_s']:.3f}s",
                  file=sys.stderr)

    med = {c: {k: statistics.median(x[k] for x in results[c])
               for k in ("stall_s", "first_s", "overhead_s", "step_s", "ckpt_mib")} for c in CONFIGS}
    ref = med["torch"]
    first = results["torch"][0]
    print(f"\nLightning checkpoint stall: MLP {first['layers']}x{args.width}^2 (~{args.params_mib:.0f} MiB fp32 params"
          f" + Adam), batch {args.batch}, 1 CPU process, a checkpoint every {args.every} steps,"
          f" {args.checkpoints} per fit, median of {args.repeats} runs; ratio = torch / config\n")
    print(f"| plugin            | ckpt MiB | step s | stall s/ckpt | ratio | overhead s/ckpt | ratio |")
    print(f"|-------------------|---------:|-------:|-------------:|------:|----------------:|------:|")
    for c in CONFIGS:
        m = med[c]
        print(f"| {c:17s} | {m['ckpt_mib']:8.1f} | {m['step_s']:6.3f} | {m['stall_s']:12.3f} | "
              f"{ref['stall_s'] / m['stall_s']:5.2f} | {m['overhead_s']:15.3f} | "
              f"{_ratio(ref['overhead_s'], m['overhead_s'])} |")
    ratio = ref["stall_s"] / med["bcp async"]["stall_s"]
    print(f"\ntarget: bcp async stall far below torch's (ratio >> 1): {ratio:.1f}x "
          f"({'met' if ratio >= 3 else 'MISSED'} at >= 3x)")
    what = f"Lightning 1 process, ~{args.params_mib:.0f} MiB params + Adam"
    figure(f"{what}: async checkpoint stall", med["bcp async"]["stall_s"], ref["stall_s"], "<= 0.33",
           peer_name="TorchCheckpointIO (torch.save on the training thread)")
    figure(f"{what}: async checkpoint stall", med["bcp async"]["stall_s"], med["torch async"]["stall_s"],
           peer_name="AsyncCheckpointIO(TorchCheckpointIO)")
    figure(f"{what}: sync checkpoint stall", med["bcp sync"]["stall_s"], ref["stall_s"],
           peer_name="TorchCheckpointIO (no fsync; bcp fsyncs)")
    for c in ("bcp async", "bcp async staging"):  # issue 34: what the loop pays per checkpoint, all of it
        figure(f"{what}: training overhead per checkpoint, {c}", med[c]["overhead_s"], med["torch async"]["overhead_s"],
               "<= 1", peer_name="AsyncCheckpointIO(TorchCheckpointIO)")
        figure(f"{what}: first checkpoint stall, {c} (automatic warm-up)", med[c]["first_s"], med[c]["stall_s"], "",
               peer_name="its own steady-state stall")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": results, "median": med}, f, indent=1)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:5.2f}" if b > 1e-3 else "  inf"


def _forward(args: argparse.Namespace) -> list[str]:
    out = []
    for name in ("params_mib", "width", "batch", "checkpoints", "every"):
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.dir:
        out += ["--dir", args.dir]
    return out


if __name__ == "__main__":
    main()
