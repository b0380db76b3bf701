"""Launch torchtitan's real Trainer on N CPU processes (gloo), time-limited, for the tests.

    from launch import make_dataset, run
    data = make_dataset(tmp_path / "data")
    out = run(2, dict(steps=4, data_dir=data, dump=str(tmp_path / "run"), manager="bcp"), timeout=240)
    out[0]["losses"]    # {step: loss}, rank 0's view of the global loss

The processes are tests/launcher.run_ranks' (free port, time limit, every rank killed when one
fails, the failing rank's output in the error), each running titan_rank.main(spec). Spec keys:
steps, data_dir, dump (the run's dump_folder), manager ("dcp": torchtitan's, "bcp": ours),
interval, async_mode, bcp (more ByteCheckpointManager.Config fields), enable, keep_latest_k,
load_step, exclude, checkpoint (other checkpoint Config fields), seq_len, local_batch, global_batch, dp_shard, dp_replicate, tp, pp, pp_schedule,
pp_microbatch, pp_layers_per_stage. As a script: `python tests/torchtitan/launch.py N SPEC_JSON`.
"""
from __future__ import annotations

import json
import os
import random
import sys
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: the shared launcher

from launcher import run_ranks  # noqa: E402


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
    """Run one training job; returns each rank's record (losses per step, token batches, timings).
    A failed or timed-out run raises AssertionError with the failing rank's output."""
    spec = dict(spec, data_dir=os.fspath(spec["data_dir"]), dump=os.fspath(spec["dump"]))
    spec.setdefault("out", os.path.join(spec["dump"], "record"))
    os.makedirs(spec["dump"], exist_ok=True)
    cache = os.path.join(spec["dump"], "hf_cache")
    env = dict(PYTHONPATH=os.pathsep.join((ROOT, HERE)), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_DATASETS_CACHE=cache, HF_HOME=os.path.join(cache, "home"), WANDB_MODE="disabled",
               TORCHINDUCTOR_CACHE_DIR=cache, LOCAL_WORLD_SIZE=str(nproc))
    run_ranks("titan_rank:main", nproc, args={"spec": spec}, timeout=timeout, extra_env=env)
    records = []
    for rank in range(nproc):
        with open(f"{spec['out']}-r{rank}.json") as f:
            rec = json.load(f)
        rec["losses"] = {int(k): v for k, v in rec["losses"].items()}
        rec["batches"] = {int(k): v for k, v in rec["batches"].items()}
        records.append(rec)
    return records


if __name__ == "__main__":
    n, spec_json = int(sys.argv[1]), sys.argv[2]
    for rank, rec in enumerate(run(n, json.loads(spec_json), timeout=float(os.environ.get("TT_TIMEOUT", 600)))):
        print(rank, {s: round(v, 6) for s, v in sorted(rec["losses"].items())})
