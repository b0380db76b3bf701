"""`make demo`: the whole story, Lightning and Accelerate, on CPU, in a few minutes.

For each framework: fine-tune all-MiniLM-L6-v2 on 2 nodes (two torchrun elastic agents on this
machine, one process each, c10d rendezvous) with async bytecheckpoint saves; lose one node
(SIGKILL of its agent and process); torchrun restarts the survivor on a world of 1 and the same
script resumes by itself from the newest committed checkpoint, finishes, and the result is
exported to Hugging Face safetensors and reloaded with from_pretrained. Then the same first job
runs with the framework's own checkpointing to compare the training stall per save. Prints a
table (markdown), writes runs/demo/results.json and the plot runs/demo/demo.png (runs/ is
gitignored: the checkout stays clean). The README's picture, docs/demo.png, is committed and
redrawn only when asked (`make demo-picture`: --replot). On a cluster every node runs the same
torchrun command: README.md, docs/elastic.md.

    python examples/demo.py            # ~3-5 min on 2 cores
    python examples/demo.py --quick    # smoke run (tests)
    python examples/demo.py --replot runs/demo/results.json --plot docs/demo.png   # make demo-picture
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import minilm_task as task  # noqa: E402

import accelerate_finetune  # noqa: E402
import lightning_finetune  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default=str(HERE.parent / "runs" / "demo"))
    p.add_argument("--plot", default=None, help="the picture (default: WORKDIR/demo.png; '' for none)")
    p.add_argument("--replot", metavar="RESULTS", help="no training: the table and picture of a results.json")
    p.add_argument("--max-steps", type=int, default=28)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--stop-at", type=int, default=19)
    p.add_argument("--frameworks", default="lightning,accelerate")
    p.add_argument("--quick", action="store_true", help="a smoke run: 6 steps, a save every 2, node lost at 3")
    return p.parse_args(argv)


FRAMEWORKS = {
    "lightning": (lightning_finetune, "torch", "Lightning"),
    "accelerate": (accelerate_finetune, "accelerate", "Accelerate"),
}


def run(args) -> dict:
    if args.quick:
        args.max_steps, args.save_every, args.stop_at = 6, 2, 3
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    common = ["--max-steps", str(args.max_steps), "--save-every", str(args.save_every), "--stop-at",
              str(args.stop_at), "--quiet"]
    results = {}
    t0 = time.perf_counter()
    for name in args.frameworks.split(","):
        module, default_io, title = FRAMEWORKS[name]
        print(f"\n######## {title}: bytecheckpoint (async), 2 nodes under torchrun -> lost node -> 1 node -> export")
        bcp_run = module.main(["--workdir", str(workdir / name), *common])
        print(f"\n######## {title}: the same first job with the framework's own checkpointing")
        default_run = module.main(["--workdir", str(workdir / f"{name}-default"), "--checkpoint-io", default_io,
                                   "--no-resume", *common])
        results[name] = {"title": title, "bytecheckpoint": bcp_run, "default": default_run,
                         "log": task.RunLog.read(str(workdir / name / "log.jsonl"))}
    results["seconds"] = time.perf_counter() - t0
    (workdir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    return results


def _mean(xs):
    return statistics.mean(xs) if xs else float("nan")


def _lines(report) -> list:
    """A resume's data-order report: one line (Lightning) or one per prepared loader (Accelerate)."""
    if not report:
        return ["(none reported)"]
    lines = [s.replace("data order: ", "", 1) for s in ([report] if isinstance(report, str) else report)]
    return [s.split("): ", 1)[0] + ")" if s.startswith("exact (") and "): " in s else s for s in lines]


def table(results: dict) -> str:
    names = [n for n in FRAMEWORKS if n in results]
    rows = [("", [results[n]["title"] for n in names])]

    def row(label, fn):
        rows.append((label, [fn(results[n]) for n in names]))

    # The first two async saves also allocate the two (ping-pong) staging buffer sets; after that
    # a save only copies into them. Both are shown; "steady" is the mean of the saves after those.
    def stalls(r, key):
        xs = r[key]["stall_s"]
        first, rest = xs[:2], xs[2:]
        steady = f"{_mean(rest):.2f} s" if rest else "n/a"
        return f"{', '.join(f'{x:.2f}' for x in first)} s; then {steady}"

    def ratio(r):
        d, b = r["default"]["stall_s"], r["bytecheckpoint"]["stall_s"]
        d, b = (d[2:], b[2:]) if len(d) > 2 and len(b) > 2 else (d, b)
        return f"{_mean(d) / _mean(b):.1f}x"

    row("stall per save, framework default: first two; then (mean)", lambda r: stalls(r, "default"))
    row("stall per save, bytecheckpoint async: first two; then (mean)", lambda r: stalls(r, "bytecheckpoint"))
    row("steady-state stall reduction", ratio)
    row("node lost at step / resumed from step",
        lambda r: f"{r['bytecheckpoint']['killed_at']} / {r['bytecheckpoint']['resumed_from']}")
    row("node lost -> first step on 1 process (torchrun restarts the survivor)",
        lambda r: f"{r['bytecheckpoint']['recovery_s']:.1f} s")
    row("  of which: new process start -> first step",
        lambda r: f"{r['bytecheckpoint']['resume_s']:.1f} s")
    row("  of which: checkpoint load (saved by 2 processes)",
        lambda r: f"{r['bytecheckpoint']['load_s']:.2f} s")
    row("held-out loss of saved weights: at save (2 procs) / after resume (1 proc)",
        lambda r: f"{r['bytecheckpoint']['eval_at_save']:.5f} / {r['bytecheckpoint']['eval_after_resume']:.5f}")
    row("data order after the resume (issue 32)", lambda r: "; ".join(_lines(r["bytecheckpoint"].get("data_order"))))
    row("train loss: step 1 / last 3 before checkpoint / first 3 after resume",
        lambda r: f"{r['bytecheckpoint']['first_loss']:.3f} / {r['bytecheckpoint']['loss_before']:.3f} / "
                  f"{r['bytecheckpoint']['loss_after']:.3f}")
    row("final held-out loss / accuracy",
        lambda r: f"{r['bytecheckpoint']['final']['eval_loss']:.3f} / {r['bytecheckpoint']['final']['accuracy']:.2f}")
    row("export -> from_pretrained: same held-out loss",
        lambda r: "yes" if abs(r["bytecheckpoint"]["reloaded"]["loss"] - r["bytecheckpoint"]["final"]["eval_loss"])
        < 1e-5 else f"NO ({r['bytecheckpoint']['reloaded']['loss']:.6f})")
    widths = [max(len(label) for label, _ in rows)] + [max(len(cells[i]) for _, cells in rows) for i in range(len(names))]
    lines = []
    for k, (label, cells) in enumerate(rows):
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip([label, *cells], widths)) + " |")
        if k == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in FRAMEWORKS if n in results]
    fig, axes = plt.subplots(1, len(names) + 1, figsize=(5 * (len(names) + 1), 3.8))
    for ax, name in zip(axes, names):
        r = results[name]
        b = r["bytecheckpoint"]
        for phase, style, label in (("train", "-", "2 nodes"), ("resume", "-", "restarted on 1 node")):
            pts = sorted((x["step"], x["loss"]) for x in r["log"] if x.get("phase") == phase and x.get("event") == "loss")
            if pts:
                ax.plot(*zip(*pts), style, marker=".", label=label)
        ax.axvline(b["killed_at"], color="red", ls=":", label=f"node lost (step {b['killed_at']})")
        ax.axvline(b["resumed_from"], color="gray", ls="--", label=f"checkpoint (step {b['resumed_from']})")
        ax.set_title(f"{r['title']}: training loss across the loss of a node")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss (global batch)")
        ax.legend(fontsize=8)
    ax = axes[-1]
    width = 0.38
    for i, name in enumerate(names):
        r = results[name]
        for j, (key, label) in enumerate((("default", "framework default"), ("bytecheckpoint", "bytecheckpoint async"))):
            stalls = r[key]["stall_s"]
            xs = [i * (max(len(stalls), 1) + 1) + k + (j - 0.5) * width for k in range(len(stalls))]
            ax.bar(xs, stalls, width, color=("tab:orange" if j == 0 else "tab:blue"),
                   label=label if i == 0 else None)
        ax.text(i * (len(r["default"]["stall_s"]) + 1) + (len(r["default"]["stall_s"]) - 1) / 2, 0, r["title"],
                ha="center", va="top", transform=ax.get_xaxis_transform(), fontsize=9)
    ax.set_xticks([])
    ax.set_title("training stall per checkpoint save (2 nodes)")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot is None:
        args.plot = str(Path(args.workdir) / "demo.png")
    if args.replot:
        results = json.loads(Path(args.replot).read_text())
    else:
        results = run(args)
    print("\n" + "=" * 100)
    print(table(results))
    print(f"\n(all of it took {results['seconds'] / 60:.1f} min; details in "
          f"{args.replot or Path(args.workdir) / 'results.json'})")
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
