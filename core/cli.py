"""Command line: python -m bytecheckpoint {inspect,verify,export,import} ..."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from .errors import CheckpointError


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_inspect(args) -> int:
    from .inspect import inspect
    info = inspect(args.path)
    if args.json:
        print(json.dumps(info.to_dict(), indent=1, default=str))
        return 0 if info.complete else 2
    if not info.complete:
        print(f"INCOMPLETE: {info.problem}")
        return 2
    print(f"{info.path}: bytecheckpoint format v{info.format_version}, saved by {info.world_size} rank(s), "
          f"{len(info.tensors)} tensors, {_human(info.nbytes)}")
    rows = [("name", "dtype", "shape", "layout", "holders", "shards", "bytes")]
    for t in sorted(info.tensors, key=lambda t: t.name):
        rows.append((t.name, t.dtype, "x".join(map(str, t.shape)) or "scalar", t.layout, str(t.holders),
                     str(t.shards), _human(t.nbytes)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if info.objects:
        print(f"plain values: {', '.join(f'rank {r}: {_human(n)}' for r, n in sorted(info.objects.items()))}")
    return 0


def cmd_verify(args) -> int:
    from .inspect import verify
    show = sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        if show and total:
            width = 30
            filled = int(width * done / total)
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {_human(done)}/{_human(total)}")
            sys.stderr.flush()

    report = verify(args.path, progress=progress)
    if show:
        sys.stderr.write("\n")
    if report.ok:
        print(f"OK: {args.path} ({_human(report.checked_bytes)} checked)")
        return 0
    print(f"DAMAGED: {args.path}")
    for p in report.problems:
        print(f"  - {p}")
    return 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bytecheckpoint", description="Inspect, verify and convert checkpoints")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("inspect", help="list tensors, shapes, dtypes, layout and sizes")
    s.add_argument("path")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_inspect)
    s = sub.add_parser("verify", help="check every checksum; exit 0 only when intact")
    s.add_argument("path")
    s.set_defaults(func=cmd_verify)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
