"""Command line: python -m bytecheckpoint {inspect,verify,stats,export,convert,import} ...

Argument parsing and printing only: what is printed comes from the engine (catalog/, monitor/).
Every command exits quietly with 141 when its reader goes away (`| head`)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import List, Optional, Sequence

from ..catalog.inspect import CheckpointInfo, TensorInfo, fold, natural_key, summarize
from ..common.errors import CheckpointError
from ..monitor.record import human_bytes as _human

FULL_TABLE_MAX = 30      # checkpoints with at most this many tensors list them all by default
LARGEST = 5


def _print_table(rows: Sequence[Sequence[str]], name_width: int = 0) -> None:
    """Columns padded to their widest cell; with name_width, the first column is folded to it."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    if name_width:
        widths[0] = min(widths[0], name_width)
    for r in rows:
        names = fold(r[0], widths[0]) if name_width else [r[0]]
        print("  ".join([names[0].ljust(widths[0])] + [c.ljust(w) for c, w in zip(r[1:], widths[1:])]).rstrip())
        for extra in names[1:]:
            print(extra)


def _counts(c) -> str:
    return ", ".join(f"{k} {v}" if len(c) > 1 else str(k) for k, v in c.most_common())


def _tensor_rows(tensors: Sequence[TensorInfo]) -> List[Sequence[str]]:
    rows = [("name", "dtype", "shape", "layout", "holders", "shards", "bytes")]
    for t in sorted(tensors, key=lambda t: natural_key(t.name)):
        rows.append((t.name, t.dtype, "x".join(map(str, t.shape)) or "scalar", t.layout, str(t.holders),
                     str(t.shards), _human(t.nbytes)))
    return rows


def _listing(names: Sequence[str], room: int) -> str:
    out, used = [], 0
    for i, n in enumerate(names):
        if used + len(n) + 2 > room and out:
            return ", ".join(out) + f" ... ({len(names) - i} more)"
        out.append(n)
        used += len(n) + 2
    return ", ".join(out)


def cmd_inspect(args) -> int:
    from ..api import inspect
    info: CheckpointInfo = inspect(args.path)
    if args.json:
        print(json.dumps(info.to_dict(), indent=1, default=str))
        return 0 if info.complete else 2
    if not info.complete:
        print(f"INCOMPLETE: {info.problem}")
        return 2
    columns = shutil.get_terminal_size((120, 24)).columns
    width = 0 if args.wide else max(40, columns - 60)
    step = info.info.get("step")
    form = "PyTorch DCP checkpoint" if info.info.get("format") == "dcp" else f"bytecheckpoint format v{info.format_version}"
    print(f"{info.path}: {form}, saved by {info.world_size} rank(s)"
          f"{f' at step {step}' if step is not None else ''}, {len(info.tensors)} tensors, {_human(info.nbytes)}")
    sizes = ", ".join(f"rank {r}: {_human(n)}" for r, n in sorted(info.objects.items())[:4])
    sizes += f" ... ({len(info.objects)} ranks)" if len(info.objects) > 4 else ""
    if args.group is not None:
        prefix = args.group.rstrip("/")
        tensors = [t for t in info.tensors if t.name == prefix or t.name.startswith(prefix + "/")]
        values = [v for v in info.values if v == prefix or v.startswith(prefix + "/")]
        if not tensors and not values:
            groups = [g.name for g in summarize(info.tensors, info.values, args.depth)]
            raise CheckpointError(f"no key under {args.group!r}; groups: {_listing(groups, 200)}")
        if tensors:
            _print_table(_tensor_rows(tensors), width)
        if values:
            print(f"plain values: {_listing(values, columns - 14)}")
        return 0
    if args.all or len(info.tensors) <= FULL_TABLE_MAX:
        _print_table(_tensor_rows(info.tensors), width)
        if info.objects:
            print(f"plain values ({sizes}): {_listing(info.values, max(40, columns - 30 - len(sizes)))}")
        return 0
    print()
    rows = [("group", "tensors", "bytes", "dtypes", "layout", "values")]
    only_values = []
    for g in summarize(info.tensors, info.values, args.depth):
        if not g.tensors:
            only_values.append(g.name)
            continue
        rows.append((g.name, str(g.tensors), _human(g.nbytes), _counts(g.dtypes), _counts(g.layouts),
                     str(g.values) if g.values else ""))
    _print_table(rows, width)
    if info.objects:
        print(f"plain values ({sizes}): {_listing(only_values, max(40, columns - 30 - len(sizes)))}")
    print("\nlargest tensors:")
    big = sorted(info.tensors, key=lambda t: (-t.nbytes, natural_key(t.name)))[:LARGEST]
    _print_table([("  " + t.name, t.dtype, "x".join(map(str, t.shape)) or "scalar", _human(t.nbytes))
                  for t in big])
    print(f"\n{len(info.tensors)} tensors: --all lists every one, --group PREFIX one group, --json all of it")
    return 0


def cmd_stats(args) -> int:
    from ..api import stats
    from ..monitor import chrome_trace, render, render_many
    if len(args.paths) > 1:
        if args.trace or args.plot:
            raise ValueError("--trace and --plot take one PATH")
        reports, failed = [], 0
        for path in args.paths:
            try:
                reports.append(stats(path, load=args.load))
            except CheckpointError as exc:
                failed += 1
                print(f"{path}: {exc}", file=sys.stderr)
        if args.json:
            print(json.dumps([r.to_dict() for r in reports], indent=1))
        else:
            print(render_many(reports))
        return 0 if reports else 2
    report = stats(args.paths[0], load=args.load)
    if args.top != 3:
        from ..monitor import analyze
        report = analyze(report.records, report.world_size, path=report.path, op=report.op, op_id=report.op_id,
                         damaged=report.damaged, stale=report.stale, committed=report.committed, top=args.top)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(render(report, details=args.details))
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump(chrome_trace(report), f)
        print(f"trace: {args.trace} (open it in https://ui.perfetto.dev or chrome://tracing)",
              file=sys.stderr if args.json else sys.stdout)
    if args.plot:
        from ..monitor.plot import plot
        plot(report, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr if args.json else sys.stdout)
    if not args.json and not args.trace and len(report.ranks) > 1:
        print("(--details: sub-phases; --trace FILE: a timeline for ui.perfetto.dev; --plot FILE: a picture)")
    return 0 if report.committed else 2


def _bar(show: bool, unit=_human):
    """A one-line progress bar on stderr when it is a terminal; a no-op otherwise. `unit` prints the
    counts (bytes by default; str for items)."""
    def progress(done: int, total: int, *_: object) -> None:
        if show and total:
            width = 30
            filled = int(width * done / total)
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {unit(done)}/{unit(total)}")
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


def cmd_convert(args) -> int:
    if args.to == "safetensors":
        return cmd_export(argparse.Namespace(path=args.src, out=args.dst, key=None, prefix=None, max_shard_size="5GB",
                                             dtype=None, overwrite=args.overwrite, config_from=None,
                                             push_to_hub=None, private=False, json=False))
    from ..checkpointer import default_checkpointer
    from .convert import convert
    comm = _torchrun_comm()
    ckpt = default_checkpointer()
    md = ckpt.metadata(args.src)
    show = sys.stderr.isatty() and (comm is None or comm.is_coordinator)
    try:
        result = convert(ckpt.storage(args.src), md, args.dst, to=args.to, layout=args.layout,
                         threads=ckpt.options.threads, allow_pickle=args.allow_pickle, overwrite=args.overwrite,
                         progress=_bar(show, str), comm=comm)
    finally:
        if comm is not None:
            import torch.distributed as dist
            dist.destroy_process_group()
    if show:
        sys.stderr.write("\n")
    if comm is not None and not comm.is_coordinator:
        return 0
    source = {"dcp": "PyTorch DCP", "deepspeed": "DeepSpeed"}.get(md.info.get("format"), "bytecheckpoint")
    print(f"converted {args.src} ({source}) to {args.dst} ({args.to}, {args.layout} layout): {result.tensors} tensors "
          f"({_human(result.nbytes)}), {result.values} plain values; files: {', '.join(result.files)}")
    return 0


def _torchrun_comm():
    """Under torchrun (WORLD_SIZE > 1): a gloo process group over the launched processes, each
    converting its share; None for one process. Its collectives are bounded by the group's timeout."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import datetime

    import torch.distributed as dist

    from ..collectives.comm import Comm
    if not dist.is_initialized():
        timeout = float(os.environ.get("BCP_COLLECTIVE_TIMEOUT_S", "1800"))
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    return Comm(None)


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


def _at_least(low: int):
    """An argparse type: an integer >= low (bad input gets argparse's usage error, exit 2)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = low - 1
        if n < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return n
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bytecheckpoint", description="Inspect, verify and convert checkpoints")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("inspect", help="tensors, shapes, dtypes, layout and sizes: a summary per group, "
                                       "then (or with --all) every tensor")
    s.add_argument("path")
    s.add_argument("--all", action="store_true", help="list every tensor (the default up to 30 tensors)")
    s.add_argument("--group", metavar="PREFIX", help="list the tensors and plain values under PREFIX")
    s.add_argument("--depth", type=_at_least(1), default=1, help="key parts that make a group (default 1)")
    s.add_argument("--wide", action="store_true", help="never fold long names (one line per tensor, for grep)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_inspect)
    s = sub.add_parser("stats", help="where every rank's save (or last load) time went; the stragglers",
                       description="Every rank's record of the save of PATH (kept beside the checkpoint): the "
                                   "time per phase (median, max, slowest ranks) and the stragglers, named with "
                                   "the phase that made them slow. Several PATHs: one line each, then the ranks "
                                   "slow more than once.")
    s.add_argument("paths", nargs="+", metavar="PATH")
    s.add_argument("--load", action="store_true", help="the last load of the checkpoint instead of its save")
    s.add_argument("--details", action="store_true", help="sub-phases (write.pack, read.io, ...) too")
    s.add_argument("--top", type=_at_least(0), default=3, help="slowest ranks shown per phase (default 3)")
    s.add_argument("--json", action="store_true", help="machine-readable report")
    s.add_argument("--trace", metavar="FILE", help="write a Chrome / Perfetto trace (one process per rank)")
    s.add_argument("--plot", metavar="FILE", help="draw every rank's phases (png, svg, pdf; needs matplotlib)")
    s.set_defaults(func=cmd_stats)
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

    s = sub.add_parser("convert", help="write a checkpoint (ours or PyTorch DCP) as PyTorch DCP, torch.save or "
                                       "safetensors, keyed as a framework writes it",
                       description="Leave bytecheckpoint: SRC (detected: bytecheckpoint, PyTorch DCP or DeepSpeed) "
                                   "written to DST as a PyTorch DCP directory (dcp.load, torchtitan's own manager, "
                                   "Accelerate's FSDP sharded folders), one torch.save file (Lightning .ckpt with "
                                   "--layout lightning) or safetensors (= export). DCP output holds a 32 MiB batch of "
                                   "tensors per writer in memory; under torchrun every process writes its share. "
                                   "docs/switching.md")
    s.add_argument("src", metavar="SRC", help="checkpoint (directory or URL)")
    s.add_argument("dst", metavar="DST", help="output (local directory for dcp/safetensors, file for torch)")
    s.add_argument("--to", choices=["dcp", "torch", "safetensors"], required=True, help="output format")
    s.add_argument("--layout", choices=["plain", "torchtitan", "lightning", "accelerate"], default="plain",
                   help="key layout: plain (the saved nesting), torchtitan (its DCP CheckpointManager's), "
                        "lightning (its checkpoint dict), accelerate (SRC: attach's <save_state dir>/bytecheckpoint; "
                        "DST: a save_state folder of FSDP SHARDED_STATE_DICT DCP folders)")
    s.add_argument("--allow-pickle", action="store_true", help="decode pickled plain values (trusted sources only)")
    s.add_argument("--overwrite", action="store_true", help="replace an existing output")
    s.set_defaults(func=cmd_convert)

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
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:  # the reader went away (`| head`): say nothing more
        # stdout to devnull, so the interpreter's last flush cannot fail again (Python's signal docs)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a Unix tool killed by the closed pipe reports
    except (CheckpointError, ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
