"""Launch torchtitan's real Trainer on N CPU processes (gloo), time-limited, for the tests.

    from launch import make_dataset, run
    data = make_dataset(tmp_path / "data")
    out = run(2, dict(steps=4, data_dir=data, dump=str(tmp_path / "run"), manager="bcp"), timeout=240)
    out[0]["losses"]    # {step: loss}, rank 0's view of the global loss

Every rank is `python worker.py` with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* set and a free port.
If any rank fails or the time limit passes, every rank is killed and the error carries the
failing rank's output tail. As a script: `python tests/torchtitan/launch.py N SPEC_JSON`.
"""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_dataset(directory, documents: int = 400, seed: int = 0) -> str:
    """A small text dataset in torchtitan's c4_test form (one JSON line per document, 'text')."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "checkpoint", "shard", "rank", "tensor", "step", "loss",
             "pipeline", "stage", "expert", "token", "batch", "resume", "layout", "elastic", "node", "gloo"]
    with open(os.path.join(directory, "train.jsonl"), "w") as f:
        for i in range(documents):
            text = f"doc {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(5, 40)))
            f.write(json.dumps({"text": text}) + "\n")
    return directory


def run(nproc: int, spec: Dict[str, Any], timeout: float = 300) -> List[Dict[str, Any]]:
    """Run one training job; returns each rank's record (losses per step, token batches)."""
    spec = dict(spec)
    spec.setdefault("out", os.path.join(spec["dump"], "record"))
    os.makedirs(spec["dump"], exist_ok=True)
    port = free_port()
    cache = os.path.join(spec["dump"], "hf_cache")
    path = os.pathsep.join(p for p in (ROOT, HERE, os.environ.get("PYTHONPATH", "")) if p)
    procs, logs = [], []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=path, OMP_NUM_THREADS="1", TT_SPEC=json.dumps(spec),
                   HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=cache,
                   HF_HOME=os.path.join(cache, "home"), WANDB_MODE="disabled", TORCHINDUCTOR_CACHE_DIR=cache)
        log = open(os.path.join(spec["dump"], f"rank{rank}.log"), "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "worker.py")], env=env,
                                      stdout=log, stderr=subprocess.STDOUT, cwd=spec["dump"]))
    deadline = time.monotonic() + timeout
    failed = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"torchtitan on {nproc} processes timed out after {timeout}s\n" + _tails(logs))
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if failed is not None:
        raise RuntimeError(f"torchtitan rank {failed} failed (exit {procs[failed].returncode}):\n" +
                           _tails(logs, only=failed))
    for log in logs:
        log.close()
    records = []
    for rank in range(nproc):
        with open(f"{spec['out']}-r{rank}.json") as f:
            rec = json.load(f)
        rec["losses"] = {int(k): v for k, v in rec["losses"].items()}
        rec["batches"] = {int(k): v for k, v in rec["batches"].items()}
        records.append(rec)
    return records


def _tails(logs, only=None, chars: int = 6000) -> str:
    out = []
    for r, log in enumerate(logs):
        if only is not None and r != only:
            continue
        log.flush()
        log.seek(0)
        out.append(f"--- rank {r} ---\n{log.read()[-chars:]}")
    return "\n".join(out)


if __name__ == "__main__":
    n, spec_json = int(sys.argv[1]), sys.argv[2]
    for rank, rec in enumerate(run(n, json.loads(spec_json), timeout=float(os.environ.get("TT_TIMEOUT", 600)))):
        print(rank, {s: round(v, 6) for s, v in sorted(rec["losses"].items())})
