"""A training run's steady synchronous save and its resume, cold and warm, for the real model's shape
of bench_real_model.py (24 Llama-shaped blocks + AdamW after one step: 876 tensors, ~405 MiB),
against DCP and torch.save + fsync, same run.

    python benchmarks/bench_steady.py [--quick] [--blocks 24] [--saves 8] [--rounds 2] [--peers a,b]
                                      [--dir D] [--json out.json]

Why a loop: one save into an empty disk is not what a run sees. In a steady loop with old
checkpoints kept, buffered writes (page cache + fdatasync) swing with the writeback of the saves
before them, O_DIRECT ones do not; this benchmark chose bytecheckpoint's default (direct_io="auto":
O_DIRECT where the file system takes it, core/storage/posix.py). Each peer runs in its own fresh
process (the page-cache state of one peer must not leak into another's):
  save loop   --saves times: 2 real training steps (forward, backward, AdamW), then a sync save (timed:
              it returns when durable) into a new step_<k> directory, then keep_last=2 retention
              (older checkpoints deleted; the last two stay on disk, as in a run). Steady state =
              the saves after the first 2: their mean (what the loop loses per save, the figure
              compared) and their median.
  resume      a new process (a resume is one): a fresh model and AdamW built untimed, then the load
              from the peer's last checkpoint timed, as bench_real_model.py loads. cold: page cache
              dropped (sync; echo 1 > /proc/sys/vm/drop_caches, root only) before the process starts;
              warm: again in a new process right after that first load. Each load is checked
              against a checksum of the state taken at save time (a broken load must not look fast).
Peers: bcp-auto (default options), bcp-direct (direct_io=True), bcp-buffered (direct_io=False), dcp
(get_state_dict + dcp.save, FileSystemWriter, no process group), torch.save+fsync. Rounds interleave
the peers (rotated each round) so machine drift hits all alike; figures are medians over rounds.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Any, Callable, Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_real_model import VOCAB, count_files, drop_page_cache, model_and_optim, torch_save_fsynced  # noqa: E402
from figures import PREFIX, figure  # noqa: E402

PEERS = ("bcp-auto", "bcp-direct", "bcp-buffered", "dcp", "torch.save+fsync")
BCP_DIRECT_IO = {"bcp-auto": "auto", "bcp-direct": True, "bcp-buffered": False}
WARMUP_SAVES = 2    # the first saves meet an empty directory and no write-path samples yet
KEEP_LAST = 2
TRAIN_STEPS = 2     # between saves
RESULT = "RESULT "  # a worker's last stdout line: RESULT {json}

# --------------------------------------------------------------- worker side: one fresh process each


def train_step(model, optim) -> None:
    model(torch.randint(0, VOCAB, (2, 8))).float().pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


def state_tensors(model, optim):
    """Every tensor a resume must restore, named, in a fixed order."""
    yield from sorted(model.state_dict().items())
    for pid, state in sorted(optim.state_dict()["state"].items()):
        for name, t in sorted(state.items()):
            yield f"optim.{pid}.{name}", t


def checksum(model, optim) -> int:
    crc = 0
    for name, t in state_tensors(model, optim):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
    return crc


def make_saver(peer: str, model, optim) -> Tuple[Callable[[str], None], Callable[[], None]]:
    """(save(path), close()): a synchronous save, durable when it returns."""
    if peer in BCP_DIRECT_IO:
        import bytecheckpoint as bcp
        ckpt = bcp.Checkpointer(direct_io=BCP_DIRECT_IO[peer])
        return (lambda p: ckpt.save(p, {"model": model, "optim": optim})), ckpt.close
    if peer == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        def dcp_save(p: str) -> None:
            msd, osd = get_state_dict(model, optim)
            dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(p))
        return dcp_save, lambda: None

    def torch_save(p: str) -> None:
        os.makedirs(p)
        torch_save_fsynced({"model": model.state_dict(), "optim": optim.state_dict()}, os.path.join(p, "state.pt"))
    return torch_save, lambda: None


def make_loader(peer: str, model, optim) -> Callable[[str], None]:
    """load(path) into a fresh model and AdamW, as bench_real_model.py resumes each peer."""
    if peer in BCP_DIRECT_IO:
        import bytecheckpoint as bcp
        ckpt = bcp.Checkpointer(direct_io=BCP_DIRECT_IO[peer])
        return lambda p: ckpt.load(p, {"model": model, "optim": optim})
    if peer == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        def dcp_load(p: str) -> None:  # get_state_dict makes the fresh optimizer's state (timed: DCP needs it)
            msd, osd = get_state_dict(model, optim)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, storage_reader=dcp.FileSystemReader(p))
            set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        return dcp_load

    def torch_load(p: str) -> None:
        sd = torch.load(os.path.join(p, "state.pt"), weights_only=True)
        model.load_state_dict(sd["model"])
        optim.load_state_dict(sd["optim"])
    return torch_load


def save_loop(job: Dict[str, Any]) -> Dict[str, Any]:
    peer, root = job["peer"], job["dir"]
    model, optim = model_and_optim(job["blocks"])
    save, close = make_saver(peer, model, optim)
    os.makedirs(root, exist_ok=True)
    times: List[float] = []
    files: List[int] = []
    for k in range(1, job["saves"] + 1):
        for _ in range(TRAIN_STEPS):
            train_step(model, optim)
        path = os.path.join(root, f"step_{k}")
        t0 = time.perf_counter()
        save(path)
        times.append(time.perf_counter() - t0)
        files.append(count_files(path))
        if k > KEEP_LAST:  # retention, keep_last=2: the older ones stay on disk until then
            shutil.rmtree(os.path.join(root, f"step_{k - KEEP_LAST}"))
    close()
    tensors = list(state_tensors(model, optim))
    return {"times": times, "files": files, "last": path, "checksum": checksum(model, optim),
            "tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for _, t in tensors)}


def resume(job: Dict[str, Any]) -> Dict[str, Any]:
    model, optim = model_and_optim(job["blocks"], trained=False)
    load = make_loader(job["peer"], model, optim)
    t0 = time.perf_counter()
    load(job["path"])
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "ok": checksum(model, optim) == job["checksum"]}


# --------------------------------------------------------------- driver side


def run_worker(job: Dict[str, Any]) -> Dict[str, Any]:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(job)],
                          capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"{job['kind']} worker for {job['peer']} failed (exit {proc.returncode})")
    return json.loads(lines[-1][len(RESULT):])


def timed_resume(job: Dict[str, Any], label: str) -> float:
    out = run_worker(job)
    if not out["ok"]:
        print(f"LOAD MISMATCH: {job['peer']} {label} resume restored a different state; time not counted", flush=True)
        return float("nan")
    return out["seconds"]


def one_round(root: str, peers: List[str], args, r: int, cold: bool) -> Dict[str, Dict[str, Any]]:
    order = peers[r % len(peers):] + peers[:r % len(peers)]
    res: Dict[str, Dict[str, Any]] = {}
    for peer in order:
        d = os.path.join(root, peer.replace("+", "_"))
        shutil.rmtree(d, ignore_errors=True)
        res[peer] = run_worker({"kind": "save", "peer": peer, "dir": d, "blocks": args.blocks, "saves": args.saves})
        print(f"round {r + 1} {peer:17s} saves {[round(t, 3) for t in res[peer]['times']]} s", flush=True)
    for peer in order:
        job = {"kind": "resume", "peer": peer, "path": res[peer]["last"], "blocks": args.blocks,
               "checksum": res[peer]["checksum"]}
        if cold and drop_page_cache():
            res[peer]["cold"] = timed_resume(job, "cold")
        else:
            run_worker(job)  # the first load, untimed: it warms the page cache
        res[peer]["warm"] = timed_resume(job, "warm")
        print(f"round {r + 1} {peer:17s} resume cold {res[peer].get('cold', float('nan')):.3f} s, "
              f"warm {res[peer]['warm']:.3f} s", flush=True)
    return res


def median(xs: List[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


def summarize(rounds: List[Dict[str, Dict[str, Any]]], peers: List[str]) -> Dict[str, Dict[str, float]]:
    out = {}
    for peer in peers:
        runs = [r[peer] for r in rounds]
        steady = [x["times"][WARMUP_SAVES:] or x["times"] for x in runs]
        save_s = median([statistics.mean(t) for t in steady])  # what the loop loses per save
        out[peer] = {"save_s": save_s, "save_median_s": median([median(t) for t in steady]),
                     "save_max_s": max(max(t) for t in steady), "mb_s": runs[0]["bytes"] / 1e6 / save_s,
                     "files": median([median(x["files"]) for x in runs]),
                     "cold_s": median([x.get("cold", float("nan")) for x in runs]),
                     "warm_s": median([x["warm"] for x in runs])}
    return out


def print_table(summary: Dict[str, Dict[str, float]]) -> None:
    print("\n| peer | steady save, mean (s) | median | slowest | MB/s (mean) | objects per save | resume cold (s) "
          "| resume warm (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for peer, s in summary.items():
        print(f"| {peer} | {s['save_s']:.3f} | {s['save_median_s']:.3f} | {s['save_max_s']:.3f} | {s['mb_s']:.0f} | "
              f"{s['files']:.0f} | {s['cold_s']:.3f} | {s['warm_s']:.3f} |")
    print(flush=True)


def figure_rows(summary: Dict[str, Dict[str, float]], blocks: int, cold: bool) -> List[Dict[str, Any]]:
    """bcp-auto against its targets; bcp-direct / bcp-buffered the same, untargeted (to choose the default)."""
    cases = [("save_s", "steady sync save", "dcp", "<= 0.8", "DCP save (FileSystemWriter, fsync)"),
             ("save_s", "steady sync save", "torch.save+fsync", "<= 1.2", "torch.save + fsync"),
             ("cold_s", "resume cold", "dcp", "<= 0.6", "DCP get_state_dict + load + set_state_dict, cold"),
             ("warm_s", "resume warm", "dcp", "", "DCP get_state_dict + load + set_state_dict, warm")]
    rows = []
    for bcp_peer in (p for p in BCP_DIRECT_IO if p in summary):
        for key, what, peer, target, peer_name in cases:
            if peer not in summary or (key == "cold_s" and not cold):
                continue
            rows.append(figure(f"real model, 1 process: {what}, {bcp_peer} vs {peer} ({blocks} blocks)",
                               summary[bcp_peer][key], summary[peer][key], target if bcp_peer == "bcp-auto" else "",
                               peer_name=peer_name, emit=False))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="where the temporary checkpoint directory goes (default /tmp)")
    p.add_argument("--blocks", type=int, default=24)
    p.add_argument("--saves", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--quick", action="store_true", help="8 blocks, 4 saves, 1 round")
    p.add_argument("--json", default=None, help="write every number here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        job = json.loads(args.worker)
        print(RESULT + json.dumps((save_loop if job["kind"] == "save" else resume)(job)), flush=True)
        return
    if args.quick or os.environ.get("BCP_BENCH_QUICK") == "1":
        args.blocks, args.saves, args.rounds = 8, 4, 1
    peers = [x.strip() for x in args.peers.split(",") if x.strip()]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        p.error(f"unknown peers {unknown}; peers are {list(PEERS)}")
    cold = drop_page_cache()
    if not cold:
        print("COLD UNAVAILABLE: cannot write /proc/sys/vm/drop_caches (needs root); cold resumes skipped", flush=True)
    root = tempfile.mkdtemp(prefix="bcp-steady-", dir=args.dir)
    try:
        rounds = [one_round(root, peers, args, r, cold) for r in range(args.rounds)]
        first = rounds[0][peers[0]]
        print(f"state: {args.blocks} blocks, {first['tensors']} tensors, {first['bytes'] / 2 ** 20:.0f} MiB; "
              f"{args.saves} saves per loop (steady: after the first {WARMUP_SAVES}), {args.rounds} round(s), "
              f"dir {root}", flush=True)
        summary = summarize(rounds, peers)
        print_table(summary)
        rows = figure_rows(summary, args.blocks, cold)
        for row in rows:
            print(f"ratio {row['figure']}: {row['ratio']} (target {row['target'] or 'none'})")
        for row in rows:
            print(PREFIX + json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "cold_available": cold, "rounds": rounds, "summary": summary,
                           "figures": rows}, f, indent=1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
