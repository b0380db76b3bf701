"""Save/load throughput: bytecheckpoint to local disk vs to an S3 server (SeaweedFS on 127.0.0.1),
next to torch.distributed.checkpoint (DCP) to local disk and to S3 through fsspec/s3fs.

    .venv/bin/python benchmarks/bench_s3.py [--mib 512] [--tensors 16] [--repeat 3] [--json OUT]

One process, a state of `--tensors` float32 tensors totalling `--mib` MiB. Each repeat saves to
a fresh path (sync save, commit included) and loads into preallocated tensors; the median is
reported. The S3 server keeps its data on the same disk as the local runs. DCP over S3 needs
`s3fs` (pip install s3fs; not a project dependency) and is skipped without it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "integration"))

import bytecheckpoint as bcp  # noqa: E402
from seaweed import SeaweedS3  # noqa: E402


def make_state(mib: int, n: int):
    per = mib * (1 << 20) // 4 // n
    cols = 1024
    rows = max(1, per // cols)
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(rows, cols, generator=g) for i in range(n)}


def nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_bcp(url, state, opts, repeat):
    saves, loads = [], []
    for r in range(repeat):
        path = f"{url}/r{r}"
        saves.append(timed(lambda: bcp.save(path, state, storage_options=opts).wait()))
        target = {k: torch.empty_like(v) for k, v in state.items()}
        loads.append(timed(lambda: bcp.load(path, target, storage_options=opts)))
        assert all(torch.equal(target[k], state[k]) for k in state)
    return saves, loads


def bench_dcp(url, state, repeat, fsspec_kwargs=None):
    import torch.distributed.checkpoint as dcp
    saves, loads = [], []
    for r in range(repeat):
        path = f"{url}/r{r}"
        if fsspec_kwargs is None:
            writer = dcp.FileSystemWriter(path)
            reader_factory = lambda: dcp.FileSystemReader(path)  # noqa: E731
        else:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
            writer = FsspecWriter(path, **fsspec_kwargs)
            reader_factory = lambda: FsspecReader(path, **fsspec_kwargs)  # noqa: E731
        saves.append(timed(lambda: dcp.save(state, storage_writer=writer)))
        target = {k: torch.empty_like(v) for k, v in state.items()}
        loads.append(timed(lambda: dcp.load(target, storage_reader=reader_factory())))
        assert all(torch.equal(target[k], state[k]) for k in state)
    return saves, loads


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=os.path.join(HERE, "out", "bench_s3.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    state = make_state(args.mib, args.tensors)
    size = nbytes(state)
    mib = size / (1 << 20)
    work = tempfile.mkdtemp(prefix="bcp-bench-s3-")
    rows = []
    try:
        with SeaweedS3(os.path.join(work, "seaweed"), auth=True) as s3:
            s3.create_bucket("bench")
            opts = s3.storage_options
            runs = [("bytecheckpoint", "local disk", lambda: bench_bcp(os.path.join(work, "bcp"), state, None,
                                                                        args.repeat)),
                    ("bytecheckpoint", "s3 (SeaweedFS)", lambda: bench_bcp("s3://bench/bcp", state, opts,
                                                                            args.repeat)),
                    ("DCP", "local disk", lambda: bench_dcp(os.path.join(work, "dcp"), state, args.repeat))]
            try:
                import s3fs  # noqa: F401
                kw = {"key": opts["access_key_id"], "secret": opts["secret_access_key"],
                      "client_kwargs": {"endpoint_url": opts["endpoint"], "region_name": "us-east-1"}}
                runs.append(("DCP + fsspec/s3fs", "s3 (SeaweedFS)", lambda: bench_dcp("s3://bench/dcp", state,
                                                                                      args.repeat, kw)))
            except ImportError:
                print("s3fs is not installed: DCP over S3 skipped (pip install s3fs)")
            for system, where, fn in runs:
                try:
                    saves, loads = fn()
                except Exception as exc:  # noqa: BLE001 - report and go on with the other rows
                    print(f"{system} / {where}: failed: {type(exc).__name__}: {exc}")
                    rows.append({"system": system, "storage": where, "error": f"{type(exc).__name__}: {exc}"})
                    continue
                s, l = statistics.median(saves), statistics.median(loads)
                rows.append({"system": system, "storage": where, "save_s": round(s, 3), "load_s": round(l, 3),
                             "save_mib_s": round(mib / s, 1), "load_mib_s": round(mib / l, 1),
                             "save_all_s": [round(x, 3) for x in saves], "load_all_s": [round(x, 3) for x in loads]})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nstate: {args.tensors} float32 tensors, {mib:.0f} MiB; median of {args.repeat}; "
          f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}")
    print(f"{'system':<22}{'storage':<17}{'save s':>8}{'save MiB/s':>12}{'load s':>8}{'load MiB/s':>12}")
    for r in rows:
        if "error" in r:
            print(f"{r['system']:<22}{r['storage']:<17}  failed: {r['error'][:60]}")
        else:
            print(f"{r['system']:<22}{r['storage']:<17}{r['save_s']:>8.2f}{r['save_mib_s']:>12.0f}"
                  f"{r['load_s']:>8.2f}{r['load_mib_s']:>12.0f}")
    if args.json:
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"mib": mib, "tensors": args.tensors, "repeat": args.repeat, "cpus": os.cpu_count(),
                       "loadavg": os.getloadavg()[0], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
