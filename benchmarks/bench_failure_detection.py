"""How long a failure takes to be reported (docs/reliability.md).

    python benchmarks/bench_failure_detection.py [--dead-peer-s 30] [--request-timeout 10]

1. Dead peer: 2 gloo ranks, an async save; rank 1 is SIGKILLed from inside its storage layer while
   writing. Rank 0's handle.wait() must raise; measured from the kill to the error. Before the
   heartbeat, this waited for the whole peer timeout (600 s by default).
2. Hung object store: a real SeaweedFS server is stopped with SIGSTOP right after an async save
   starts; measured from the stop to the StorageTimeoutError naming the URL.
3. Missing peer: only rank 0 calls a collective save (rank 1 goes to a barrier); measured until
   rank 0 raises PeerTimeoutError (the arrival bound is timeout_s).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "faults"),
                os.path.join(ROOT, "tests", "integration")]


def dead_peer(dead_peer_s: float) -> float:
    from harness import Job
    with tempfile.TemporaryDirectory() as d:
        job = Job("bounded_scenarios:dead_peer_async", 2, {"path": os.path.join(d, "ck"), "dead_peer_s": dead_peer_s})
        job.finish(dead_peer_s + 120)
        found = re.search(r"DEAD PEER DETECTED after ([0-9.]+) s", job.outputs()[0])
        if not found:
            raise SystemExit(f"dead peer was not detected:\n{job.describe()}")
        return float(found.group(1))


def missing_peer(timeout_s: float) -> float:
    from harness import Job
    with tempfile.TemporaryDirectory() as d:
        job = Job("bounded_scenarios:subset_save", 2, {"path": os.path.join(d, "ck"), "timeout_s": timeout_s,
                                                         "sharded": True})
        job.finish(timeout_s + 120)
        found = re.search(r"PeerTimeoutError after ([0-9.]+) s", job.outputs()[0])
        if not found:
            raise SystemExit(f"missing peer was not reported:\n{job.describe()}")
        return float(found.group(1))


def hung_store(request_timeout: float) -> float:
    import torch

    import bytecheckpoint as bcp
    from bytecheckpoint.storage.errors import StorageTimeoutError
    from seaweed import SeaweedS3
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    with tempfile.TemporaryDirectory() as d, SeaweedS3(d) as s3:
        s3.create_bucket("hang")
        opts = {**s3.storage_options, "request_timeout": request_timeout}
        with bcp.Checkpointer(storage_options=opts) as ckpt:
            ckpt.save("s3://hang/warm", {"w": torch.ones(16)})
            handle = ckpt.save("s3://hang/ck", {"w": torch.randn(16 << 20)}, async_save=True)
            s3.pause()
            t0 = time.monotonic()
            try:
                handle.wait()
                raise SystemExit("the save finished although the server was stopped")
            except StorageTimeoutError:
                return time.monotonic() - t0
            finally:
                s3.resume()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dead-peer-s", type=float, default=30.0, help="Checkpointer(dead_peer_s=...) (default 30)")
    ap.add_argument("--request-timeout", type=float, default=10.0, help="storage_options request_timeout")
    ap.add_argument("--arrival-timeout", type=float, default=10.0, help="Checkpointer(timeout_s=...)")
    args = ap.parse_args(argv)
    rows = [
        ("dead peer during an async save (kill -9 rank 1)", f"dead_peer_s={args.dead_peer_s:g}",
         dead_peer(args.dead_peer_s), "600 s (the peer timeout)"),
        ("object store stops answering (SeaweedFS SIGSTOP) during an async save",
         f"request_timeout={args.request_timeout:g}", hung_store(args.request_timeout), "unbounded"),
        ("collective save called on rank 0 only", f"timeout_s={args.arrival_timeout:g}",
         missing_peer(args.arrival_timeout), "gloo's timeout (30 min) or forever"),
    ]
    print("| failure | setting | reported after (s) | before this round |")
    print("|---|---|---|---|")
    for what, setting, seconds, before in rows:
        print(f"| {what} | {setting} | {seconds:.1f} | {before} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
