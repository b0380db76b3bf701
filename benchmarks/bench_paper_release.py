"""bytecheckpoint against the ByteCheckpoint paper authors' own release (PyPI bytecheckpoint==0.0.2),
measured in the same run on the same FSDP2 state. Issue target: every row <= 0.8x the release.

    bash benchmarks/paper_release_venv.sh                   # once: the release's venv (/work/paper_release_venv)
    .venv/bin/python benchmarks/bench_paper_release.py [--quick] [--repeats 3] [--dir D]
        [--release-python /work/paper_release_venv/bin/python] [--json out.json]

State: a Llama-shaped model (benchmarks/release_model.py; 12 blocks of dim 256 and a 32000 vocab:
~26 M parameters, ~99 MiB) under FSDP2 (fully_shard per block, then the root) on 2 gloo ranks, with
AdamW after one step (~300 MiB with its moments). --quick: 2 blocks, vocab 8000, 1 repeat.

Rows (median of --repeats; each repeat runs both libraries, alternating which goes first):
  sync save     2 ranks, the slowest rank's time in save; both durable when it returns (ours:
                Checkpointer().save; the release: save(framework="fsdp2"), fast_saving=False)
  2 -> 2 load   into a fresh model + fresh AdamW (built untimed), as a resume does
  2 -> 1 load   the same checkpoint on 1 rank: resharded at load
  async save    the time save blocks (ours: save(async_save=True); the release: fast_saving=True);
                the time until it is committed is shown beside it, without a target
Each library's job runs in its own processes with its own interpreter (the release's import name is
also `bytecheckpoint`): benchmarks/paper_release_worker.py, launched as torchrun would. The first
save of each job is untimed for both (plans, thread pools; the release's gRPC coordinator). Every load,
and a load of each async checkpoint, is checked against the saved state (a digest of the full
tensors), so a broken load or save cannot look fast; both libraries must have saved the same state.
Floor: each rank writes one file of its state's bytes with os.write + os.fdatasync, in the same jobs.

Quirks of the release (0.0.2) handled in the worker, in the release's process only:
  * it pins torch<=2.5 but its version check compares strings, so 2.13.0 passes; it is installed with
    --no-deps beside torch==2.13.0 (the CPU build) by paper_release_venv.sh;
  * its pickled byte items need torch.load(weights_only=False) (torch >= 2.6 defaults to True):
    torch.load is wrapped with functools.partial there;
  * its gRPC coordinator announces the address the host routes to 8.8.8.8 by, with no setting to
    change it: the coordinator process is started with that lookup answering 127.0.0.1;
  * its async save returns no handle: completion is its background queues' join().
Durability as found in its source: each data file and .metadata is os.fsync'ed (inside the open file,
before Python's final buffer flush at close, so the last <= 8 KiB of a file may not be covered);
directories and the step tracker file are not fsynced. Ours fdatasyncs/fsyncs files and directories.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from figures import figure, met  # noqa: E402
from paper_release_worker import FLOOR_TRIES  # noqa: E402
from release_model import Llama  # noqa: E402

WORKER = os.path.join(HERE, "paper_release_worker.py")
DEFAULT_RELEASE_PYTHON = os.environ.get("BCP_RELEASE_PYTHON", "/work/paper_release_venv/bin/python")  # make bench sets it
TARGET = "<= 0.8"
JOB_TIMEOUT_S = 1800
FULL = {"blocks": 12, "vocab": 32000}
QUICK = {"blocks": 2, "vocab": 8000}
PEER = "ByteCheckpoint release 0.0.2 (PyPI)"


# ---------------------------------------------------------------------------------------- jobs
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(library: str, world: int) -> Dict[str, str]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
               BYTECHECKPOINT_LOGGING_LEVEL="WARNING")  # the release logs every step at INFO
    if library == "release":
        env.pop("PYTHONPATH", None)  # nothing may put our bytecheckpoint before the release's
    return env


def wait_for_ranks(procs: List[subprocess.Popen], timeout_s: float) -> None:
    """Until every rank has exited, one has failed (the others would wait on it for gloo's timeout),
    or the time is up; then ends whatever still runs."""
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def run_job(python: str, library: str, job: str, world: int, ckpt_dir: str, size: Dict[str, int],
            expect: str = "") -> Dict[str, object]:
    """Start `world` ranks of the worker (torchrun's environment) and return rank 0's RESULT."""
    env = job_env(library, world)
    cmd = [python, WORKER, "--library", library, "--job", job, "--dir", ckpt_dir,
           "--blocks", str(size["blocks"]), "--vocab", str(size["vocab"]), "--expect", expect]
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(world)]  # files, not pipes: never a full pipe
    procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=logs[r],
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    wait_for_ranks(procs, JOB_TIMEOUT_S)
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tails = "\n".join(f"--- rank {r} (exit {procs[r].returncode}) ---\n{outputs[r][-4000:]}" for r in failed)
        raise RuntimeError(f"{library} {job} job (world {world}) failed on ranks {failed}:\n{tails}")
    for line in outputs[0].splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{library} {job} job printed no RESULT:\n{outputs[0][-4000:]}")


def one_repeat(python: str, library: str, root: str, size: Dict[str, int]) -> Dict[str, object]:
    """A library's save job (2 ranks) then its 2 -> 1 load job; raises if any load was not equal."""
    ckpt_dir = tempfile.mkdtemp(prefix=f"{library}-", dir=root)
    try:
        saved = run_job(python, library, "save", 2, ckpt_dir, size)
        one = run_job(python, library, "load", 1, ckpt_dir, size, expect=str(saved["fingerprint"]))
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    saved["load_2to1"], saved["load_2to1_ok"] = one["load"], one["load_ok"]
    bad = [k for k in ("load_2to2_ok", "async_load_ok", "load_2to1_ok") if not saved[k]]
    if bad:
        raise RuntimeError(f"{library}: loaded state differs from the saved state: {bad}")
    return saved


# ---------------------------------------------------------------------------------------- report
ROWS = [  # (key in a job's result, row name, target)
    ("sync_save", "FSDP2 2 ranks: sync save (durable)", TARGET),
    ("sync_save_model", "FSDP2 2 ranks: sync save of the model alone (durable)", TARGET),
    ("load_2to2", "FSDP2 2 -> 2 load (fresh model + AdamW)", TARGET),
    ("load_2to1", "FSDP2 2 -> 1 load (resharded)", TARGET),
    ("async_block", "FSDP2 2 ranks: async save, blocking time", TARGET),
    ("async_total", "FSDP2 2 ranks: async save, until committed", ""),
]


def median_of(results: List[Dict[str, object]], key: str) -> float:
    return statistics.median(float(r[key]) for r in results)


def report(results: Dict[str, List[Dict[str, object]]], size_note: str) -> List[Dict[str, object]]:
    """The table, the floor line and one FIGURE line per row; returns the figures."""
    ours, release = results["ours"], results["release"]
    floor = median_of(ours + release, "floor")
    per_rank_mib = float(ours[0]["floor_bytes_per_rank"]) / 2 ** 20
    ours_x, release_x = median_of(ours, "sync_save") / floor, median_of(release, "sync_save") / floor
    floor_note = (f"floor (os.write + fdatasync of {per_rank_mib:.0f} MiB per rank): {floor:.3f} s; "
                  f"ours {ours_x:.2f}x, release {release_x:.2f}x it")
    rows = [figure(f"paper release: {name} ({size_note})", median_of(ours, key), median_of(release, key), target,
                   peer_name=PEER, note=f"{size_note}; {floor_note}" if key == "sync_save" else size_note, emit=False)
            for key, name, target in ROWS]
    print_table(rows)
    print(f"floor, sync save: {per_rank_mib:.1f} MiB per rank written with os.write + os.fdatasync, both ranks at "
          f"once: {floor:.3f} s (slowest rank; best of {FLOOR_TRIES} tries per job, median over jobs); "
          f"ours {ours_x:.2f}x, release {release_x:.2f}x the floor\n", flush=True)
    for row in rows:
        figure(row["figure"], row["bcp"], row["peer"], row["target"], peer_name=PEER, note=row["note"])
    return rows


def print_table(rows: List[Dict[str, object]]) -> None:
    print("\n| row | ours s | release s | ratio ours/release | target |\n|---|---|---|---|---|")
    for (_, name, _), row in zip(ROWS, rows):
        verdict = {True: "met", False: "MISSED", None: ""}[met(row)]
        print(f"| {name} | {row['bcp']:.3f} | {row['peer']:.3f} | {row['ratio']:.2f} | {row['target']} {verdict} |")
    print()


def state_size_note(size: Dict[str, int]) -> str:
    with torch.device("meta"):
        model = Llama(size["blocks"], vocab=size["vocab"])
    params = sum(p.numel() for p in model.parameters())
    return f"{size['blocks']} blocks, {params / 1e6:.1f} M params, {params * 4 / 2 ** 20:.0f} MiB + AdamW"


# ---------------------------------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="2 blocks, vocab 8000, 1 repeat")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: the temp dir)")
    p.add_argument("--release-python", default=DEFAULT_RELEASE_PYTHON,
                   help="the interpreter of the release's venv (benchmarks/paper_release_venv.sh)")
    p.add_argument("--json", default=None, help="also write every sample and the figures to this file")
    args = p.parse_args()
    if args.quick or os.environ.get("BCP_BENCH_QUICK") == "1":
        args.repeats = 1
    args.size = QUICK if args.quick or os.environ.get("BCP_BENCH_QUICK") == "1" else FULL
    return args


def main() -> None:
    args = parse_args()
    if not os.path.exists(args.release_python):
        print(f"SKIPPED: no release interpreter at {args.release_python}; create it with "
              f"`bash benchmarks/paper_release_venv.sh` (or pass --release-python)", flush=True)
        return
    size_note = state_size_note(args.size)
    print(f"state: {size_note}; FSDP2, 2 gloo ranks; {args.repeats} repeat(s)", flush=True)
    pythons = {"ours": sys.executable, "release": args.release_python}
    results: Dict[str, List[Dict[str, object]]] = {"ours": [], "release": []}
    root = tempfile.mkdtemp(prefix="bcp-paper-release-", dir=args.dir)
    t0 = time.perf_counter()
    try:
        for i in range(args.repeats):
            order = ["ours", "release"] if i % 2 == 0 else ["release", "ours"]
            for library in order:
                r = one_repeat(pythons[library], library, root, args.size)
                results[library].append(r)
                print(f"repeat {i} {library}: " + json.dumps({k: round(v, 3) for k, v in r.items()
                                                             if isinstance(v, float)}), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    prints = {r["fingerprint"] for rs in results.values() for r in rs}
    if len(prints) != 1:
        raise RuntimeError(f"the libraries saved different states: {sorted(prints)}")
    rows = report(results, size_note)
    print(f"({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "repeats": args.repeats, "samples": results, "figures": rows}, f, indent=1)


if __name__ == "__main__":
    main()
