"""Object store (SeaweedFS S3 on 127.0.0.1), 2 gloo ranks: bytecheckpoint vs DCP + fsspec/s3fs.

    .venv/bin/python benchmarks/bench_s3.py [--quick] [--mib 512] [--reps 3]

FSDP-style state sharded over 2 ranks: save and load throughput (MiB/s of the whole state, sync
save with commit, load into preallocated tensors), interleaved, medians. Then a replicated (DDP)
state: load with zero-redundancy on vs off (the 'auto' policy turns it on for object stores).
DCP over S3 needs `s3fs` (not a project dependency); without it that peer is skipped.
The server keeps its data on the same disk and shares the 2 CPUs with the ranks.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "integration"))
sys.path.insert(0, HERE)
from figures import figure  # noqa: E402
from launcher import run_ranks  # noqa: E402
from seaweed import SeaweedS3  # noqa: E402


def bench_line(outs):
    for out in outs:
        for line in out.splitlines():
            if line.startswith("BENCH "):
                return json.loads(line[6:])
    raise RuntimeError("no BENCH line")


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--mib", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--json", default=os.path.join(HERE, "out", "bench_s3.json"))
    args = ap.parse_args(argv)
    mib = args.mib or (128 if args.quick else 512)
    reps = args.reps or (2 if args.quick else 3)
    env = {"BCP_TEST_PG_TIMEOUT_S": "900", "PYTHONPATH": HERE, "AWS_EC2_METADATA_DISABLED": "true"}
    work = tempfile.mkdtemp(prefix="bcp-bench-s3-")
    timeout = 600 + 40 * reps * max(1, mib // 64)
    try:
        with SeaweedS3(os.path.join(work, "seaweed"), auth=True) as s3:
            s3.create_bucket("bench")
            common = {"url": "s3://bench", "opts": s3.storage_options, "mib": mib, "reps": reps}
            main_run = bench_line(run_ranks("bench_ranks:s3_save_load", 2, common, timeout=timeout, extra_env=env))
            rep = bench_line(run_ranks("bench_ranks:s3_replicated", 2, dict(common, mib=mib // 2), timeout=timeout,
                                       extra_env=env))
            real = bench_line(run_ranks("bench_ranks:s3_real_model", 2,
                                        {"url": "s3://bench", "opts": s3.storage_options, "reps": reps,
                                         "blocks": 8 if args.quick else 24}, timeout=timeout, extra_env=env))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    size = main_run["total_bytes"] / 2**20
    r = {k: med(v) for k, v in main_run["results"].items()}
    print(f"\nstate: {size:.0f} MiB FSDP-sharded over 2 ranks; {reps} interleaved repetitions, medians; "
          f"load average {os.getloadavg()[0]:.1f}")
    for k in ("bcp_save", "bcp_load", "dcp_save", "dcp_load", "raw_put", "raw_get"):
        print(f"  {k}: {r[k]:.2f} s = {size / r[k]:.0f} MiB/s" if main_run["results"][k] else f"  {k}: skipped")
    if main_run["have_s3fs"]:
        figure("object store save, 2 ranks", size / r["bcp_save"], size / r["dcp_save"], ">= 2", unit="MiB/s",
               peer_name="DCP + fsspec/s3fs")
        figure("object store load, 2 ranks", size / r["bcp_load"], size / r["dcp_load"], ">= 2", unit="MiB/s",
               peer_name="DCP + fsspec/s3fs")
    else:
        print("s3fs is not installed: the DCP + s3fs peer was skipped (pip install s3fs)")
    floor = "the same bytes as 16 MiB PUTs/GETs through the same client (the server's floor)"
    figure("object store save, 2 ranks", size / r["bcp_save"], size / r["raw_put"], unit="MiB/s", peer_name=floor)
    figure("object store load, 2 ranks", size / r["bcp_load"], size / r["raw_get"], unit="MiB/s", peer_name=floor)
    rr = {k: med(v) for k, v in rep["results"].items()}
    figure("object store, replicated load 2 ranks: zero-redundancy on", rr["on"], rr["off"], "<= 0.8",
           peer_name="the same load with it off",
           note=f"bytes read on/off: {rep['bytes_read']['on'] / 2**20:.0f}/{rep['bytes_read']['off'] / 2**20:.0f} MiB")
    figure("object store, replicated load 2 ranks: zero_redundancy='auto'", rr["auto"], rr["off"],
           peer_name="zero-redundancy off")
    rm = {k: med(v) for k, v in real["results"].items()}
    real_mib = real["total_bytes"] / 2**20
    print(f"\nreal-model shapes, FSDP2 over 2 ranks: {real_mib:.0f} MiB; " +
          ", ".join(f"{k} {v:.2f}" for k, v in rm.items()))
    figure("object store, real-model shapes, 2 ranks: save", real_mib / rm["bcp_save"], real_mib / rm["raw_put"],
           ">= 0.9", unit="MiB/s", peer_name=floor)
    figure("object store, real-model shapes, 2 ranks: load", real_mib / rm["bcp_load"], real_mib / rm["raw_get"],
           ">= 0.9", unit="MiB/s", peer_name=floor)
    from bytecheckpoint.storage.packs import OBJECTS
    figure("object store, real-model shapes, 2 ranks: objects (PUTs) per save", rm["objects"],
           2 * OBJECTS.max_packs + 4, "<= 1", unit="objects",
           peer_name=f"ranks x {OBJECTS.max_packs} packs (the PUTs in flight) + 4")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"main": main_run, "replicated": rep, "real_model": real}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
