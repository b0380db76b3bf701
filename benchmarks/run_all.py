"""`make bench`: every benchmark in one go; each prints its own table with ratios.

The tables are also written under benchmarks/out/; docs/results.md holds the latest ones.
Set BCP_BENCH_QUICK=1 for a smaller, faster run (same tables, smaller state).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
QUICK = os.environ.get("BCP_BENCH_QUICK") == "1"

RUNS = [
    ("checkpoint engine vs torch.save / DCP", ["bench_checkpoint.py"] + (["--mib", "192", "--reps", "2"] if QUICK else [])),
    ("planner at scale", ["bench_planner.py"] + (["--ranks", "64", "1024"] if QUICK else [])),
    ("Lightning plugin vs TorchCheckpointIO / AsyncCheckpointIO", ["bench_lightning.py"]),
    ("Accelerate attach vs default save_state/load_state", ["bench_accelerate.py"] + (["--params-mib", "64"] if QUICK else [])),
]
if os.path.exists(os.path.join(HERE, "bench_s3.py")):
    RUNS.append(("object store (SeaweedFS S3) vs local disk", ["bench_s3.py"]))


def main() -> int:
    failed = []
    for title, cmd in RUNS:
        print(f"\n## {title}\n", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, os.path.join(HERE, cmd[0])] + cmd[1:])
        print(f"\n({cmd[0]}: {time.perf_counter() - t0:.0f} s, exit {rc})", flush=True)
        if rc:
            failed.append(cmd[0])
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
