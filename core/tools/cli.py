"""Command line: python -m bytecheckpoint {inspect,verify,export,import} ..."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from ..common.errors import CheckpointError


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_inspect(args) -> int:
    from ..api import inspect
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


def _bar(show: bool):
    """A one-line progress bar on stderr when it is a terminal; a no-op otherwise."""
    def progress(done: int, total: int, *_: object) -> None:
        if show and total:
            width = 30
            filled = int(width * done / total)
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {_human(done)}/{_human(total)}")
            sys.stderr.flush()
    return progress


def cmd_verify(args) -> int:
    from ..api import verify
    show = sys.stderr.isatty()
    report = verify(args.path, progress=_bar(show))
    if show:
        sys.stderr.write("\n")
    if report.ok:
        print(f"OK: {args.path} ({_human(report.checked_bytes)} checked)")
        return 0
    print(f"DAMAGED: {args.path}")
    for p in report.problems:
        print(f"  - {p}")
    return 1


def cmd_export(args) -> int:
    from .export import export_safetensors, push_to_hub
    show = sys.stderr.isatty() and not args.json
    result = export_safetensors(args.path, args.out, key=args.key, prefix=args.prefix,
                                max_shard_size=args.max_shard_size, dtype=args.dtype, overwrite=args.overwrite,
                                config_from=args.config_from, progress=_bar(show))
    if show:
        sys.stderr.write("\n")
    if args.push_to_hub:
        result.pushed_to = push_to_hub(args.out, args.push_to_hub, private=args.private or None)
    if args.json:
        print(json.dumps(result.__dict__, indent=1))
        return 0
    what = f"{len(result.files)} file(s)" + (f" + {result.index_file}" if result.index_file else "")
    print(f"exported {result.tensors} tensors of {args.path!r} key {result.key!r} ({_human(result.total_size)}) "
          f"to {args.out}: {what}")
    for name in result.files:
        print(f"  {name}")
    if result.copied:
        print(f"copied from {args.config_from}: {', '.join(result.copied)}")
    elif "config.json" not in os.listdir(args.out):
        print("no config.json in the output: add one (--config-from MODEL_DIR) before from_pretrained")
    if result.pushed_to:
        print(f"pushed to the Hugging Face Hub: {result.pushed_to}")
    return 0


def cmd_import(args) -> int:
    from ..api import inspect
    from .export import import_safetensors
    import_safetensors(args.hf_dir, args.out, key=args.key, dtype=args.dtype, overwrite=args.overwrite)
    info = inspect(args.out)
    print(f"imported {len(info.tensors)} tensors ({_human(info.nbytes)}) from {args.hf_dir} into {args.out} under "
          f"key {args.key!r}; load with bcp.load({args.out!r}, {{{args.key!r}: model}}) on any number of ranks")
    return 0


def _size(text: str) -> str:
    from .export import parse_size
    try:
        parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _dtype(text: str) -> str:
    from .export import parse_dtype
    try:
        return parse_dtype(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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

    s = sub.add_parser("export", help="write Hugging Face safetensors (streaming, sharded like save_pretrained)",
                       description="Write the tensors of one key (default: 'model', or the only module state "
                                   "dict) as model.safetensors or model-0000k-of-0000n.safetensors + "
                                   "model.safetensors.index.json, named as in model.state_dict().")
    s.add_argument("path", help="checkpoint (directory or URL)")
    s.add_argument("out", help="output directory (local)")
    s.add_argument("--to", choices=["safetensors"], default="safetensors", help="output format")
    s.add_argument("--key", help="top-level key (or key path) holding the state dict; default: 'model' if "
                                 "present, else the only one that holds a module state dict")
    s.add_argument("--prefix", help="keep only names starting with PREFIX and strip it (e.g. 'model.' for a "
                                    "LightningModule whose network is self.model)")
    s.add_argument("--max-shard-size", type=_size, default="5GB",
                   help="largest output file (5GB, 500MB, 2GiB, bytes); default 5GB")
    s.add_argument("--dtype", type=_dtype, help="convert floating-point tensors (bf16, fp16, fp32)")
    s.add_argument("--config-from", metavar="MODEL_DIR",
                   help="copy config.json (and tokenizer files) from a Hugging Face model folder or a config file")
    s.add_argument("--overwrite", action="store_true", help="replace the weights in an existing output directory")
    s.add_argument("--push-to-hub", metavar="REPO_ID", help="then upload the folder to the Hugging Face Hub")
    s.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    s.add_argument("--json", action="store_true", help="machine-readable summary")
    s.set_defaults(func=cmd_export)

    s = sub.add_parser("import", help="Hugging Face safetensors (single or sharded) -> a bytecheckpoint checkpoint",
                       description="Save the tensors of a safetensors file or model folder under KEY, so that "
                                   "bcp.load(OUT, {KEY: model}) loads them into any layout and world size.")
    s.add_argument("hf_dir", metavar="HF_DIR", help="model folder (model.safetensors or a sharded index) or a file")
    s.add_argument("out", help="checkpoint to create (directory or URL)")
    s.add_argument("--key", default="model", help="top-level key for the tensors (default: model)")
    s.add_argument("--dtype", type=_dtype, help="convert floating-point tensors (bf16, fp16, fp32)")
    s.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint / non-empty directory")
    s.set_defaults(func=cmd_import)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
