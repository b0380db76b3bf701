"""`make bench`: run every benchmark, collect their figures, write docs/results.md and docs/bench.png.

    python benchmarks/run_all.py [--quick] [NAME ...]     # NAME: e.g. bench_s3 (default: all)

Convention (benchmarks/figures.py): every `benchmarks/bench_*.py` that is a script (has a
`__main__` block) is run in its own process. It prints one line per figure,

    FIGURE {"figure": ..., "bcp": ..., "peer": ..., "ratio": bcp/peer, "target": "<= 0.8" | ">= 2" | "", ...}

(`figures.figure(...)` prints it), and accepts `--quick` for a smaller run (also signalled by the
environment variable BCP_BENCH_QUICK=1). Everything else a script prints is shown as it runs and
kept in benchmarks/out/<name>.log. A script that prints no FIGURE line is still run and listed.

The figures of all scripts are merged into benchmarks/out/figures.json (a run of some scripts
keeps the others' last figures; without that file, e.g. on a fresh clone, they are read back from
the table in docs/results.md), the table between the `figures` markers in docs/results.md is
rewritten (figure, bcp, peer, ratio, target, met/missed), and docs/bench.png draws one bar per
figure (ratio bcp/peer) with its target.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from figures import met, parse, target_bound  # noqa: E402

OUT = os.path.join(HERE, "out")
RESULTS = os.path.join(ROOT, "docs", "results.md")
PICTURE = os.path.join(ROOT, "docs", "bench.png")
BEGIN, END = "<!-- figures:begin (written by benchmarks/run_all.py) -->", "<!-- figures:end -->"
# Quick-mode arguments for scripts that do not take --quick yet (their owners may drop these).
LEGACY_QUICK: Dict[str, List[str]] = {}
TIMEOUT_S = {"quick": 1800, "full": 5400}


def scripts(names: List[str]) -> List[str]:
    found = []
    for fn in sorted(os.listdir(HERE)):
        name = fn[:-3]
        if not (fn.startswith("bench_") and fn.endswith(".py")) or (names and name not in names):
            continue
        with open(os.path.join(HERE, fn)) as f:
            if "__main__" in f.read():
                found.append(name)
    return found


def run(name: str, quick: bool) -> Dict[str, Any]:
    path = os.path.join(HERE, name + ".py")
    with open(path) as f:
        takes_quick = "--quick" in f.read()
    args = (["--quick"] if takes_quick else LEGACY_QUICK.get(name, [])) if quick else []
    env = dict(os.environ, BCP_BENCH_QUICK="1" if quick else "0")
    print(f"\n## {name} {' '.join(args)}\n", flush=True)
    t0 = time.perf_counter()
    lines: List[str] = []
    proc = subprocess.Popen([sys.executable, path] + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=ROOT)
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            print(line, end="", flush=True)
            lines.append(line)
        rc = proc.wait(timeout=TIMEOUT_S["quick" if quick else "full"])
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = -9
    text = "".join(lines)
    with open(os.path.join(OUT, name + ".log"), "w") as f:
        f.write(text)
    seconds = time.perf_counter() - t0
    print(f"\n({name}: {seconds:.0f} s, exit {rc}, {len(parse(text))} figures)", flush=True)
    return {"script": name, "exit": rc, "seconds": round(seconds), "quick": quick, "figures": parse(text),
            "when": time.strftime("%Y-%m-%d %H:%M")}


def from_table(text: str) -> Dict[str, Any]:
    """The runs of the table in docs/results.md (when benchmarks/out/figures.json is missing, e.g. on a
    fresh clone): a run of some scripts keeps every other script's last figures (values as printed)."""
    runs: Dict[str, Any] = {}
    if BEGIN not in text or END not in text:
        return runs
    for line in text[text.index(BEGIN):text.index(END)].splitlines():
        cells = [c.strip() for c in line.strip()[1:-1].split("|")]
        if len(cells) != 8 or cells[0] in ("figure", "---") or cells[0].startswith("---"):
            continue
        label, bcp, peer, unit, ratio, target, _, where = cells
        name, quick, ingested = where.split(" ")[0], "(quick)" in where, None
        if "(from " in where:
            ingested = os.path.join(ROOT, where.split("(from ", 1)[1].rstrip(")"))
        run = runs.setdefault(name, {"script": name, "exit": 0, "seconds": None, "quick": quick, "figures": [],
                                     "when": "", **({"ingested": ingested} if ingested else {})})
        if label.startswith("(") and "no figures" in label:
            run["exit"] = int(label.rsplit("exit ", 1)[1].rstrip(")")) if "exit " in label else 0
            continue
        cut = label.rfind(" (vs ")
        figure_name, peer_name = (label[:cut], label[cut + 5:-1]) if cut >= 0 else (label, "")
        number = lambda x: None if x in ("-", "") else float(x)  # noqa: E731
        run["figures"].append({"figure": figure_name, "bcp": number(bcp), "peer": number(peer),
                               "ratio": number(ratio), "target": target, "unit": unit,
                               "peer_name": "" if peer_name == "peer" else peer_name, "note": ""})
    return runs


def fmt(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if abs(x) < 100 else f"{x:.0f}"


def table(runs: Dict[str, Any]) -> str:
    load = os.getloadavg()[0]
    out = [f"Generated by `make bench` (benchmarks/run_all.py) on {os.cpu_count()} CPUs, load average {load:.1f} "
           f"at the end. ratio = bcp / peer (for times lower is better, for MiB/s higher is better).", "",
           "| figure | bcp | peer | unit | ratio | target | met | script |", "|---|---|---|---|---|---|---|---|"]
    for name in sorted(runs):
        r = runs[name]
        if not r["figures"]:
            out.append(f"| ({name}: no figures; exit {r['exit']}) | | | | | | | {name} |")
        for f in r["figures"]:
            ok = met(f)
            verdict = "" if ok is None else ("met" if ok else "**missed**")
            peer = f["peer_name"] or "peer"
            label = f"{f['figure']} (vs {peer})"
            where = f" (from {os.path.relpath(r['ingested'], ROOT)})" if r.get("ingested") else ""
            out.append(f"| {label} | {fmt(f['bcp'])} | {fmt(f['peer'])} | {f.get('unit', 's')} | {fmt(f['ratio'])} | "
                       f"{f['target']} | {verdict} | {name}{' (quick)' if r.get('quick') else ''}{where} |")
    return "\n".join(out)


def write_results(runs: Dict[str, Any]) -> None:
    text = open(RESULTS).read() if os.path.exists(RESULTS) else "# Measured results\n"
    block = f"{BEGIN}\n{table(runs)}\n{END}"
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        head, _, rest = text.partition("\n")
        text = f"{head}\n\n## All figures\n\n{block}\n{rest}"
    with open(RESULTS, "w") as f:
        f.write(text)


def draw(runs: Dict[str, Any]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [f for name in sorted(runs) for f in runs[name]["figures"] if f.get("ratio") is not None]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(rows) + 1.5))
    ys = list(range(len(rows)))[::-1]
    for y, f in zip(ys, rows):
        ok = met(f)
        color = "#4c72b0" if ok is None else ("#55a868" if ok else "#c44e52")
        ax.barh(y, f["ratio"], color=color, height=0.6)
        ax.text(f["ratio"], y, f" {f['ratio']:.2f}", va="center", fontsize=7)
        bound = target_bound(f["target"] or "")
        if bound is not None:
            ax.plot([bound[1], bound[1]], [y - 0.4, y + 0.4], color="black", linewidth=2)
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_yticks(ys)
    ax.set_yticklabels([f"{f['figure']} vs {f['peer_name'] or 'peer'}"[:70] for f in rows], fontsize=7)
    ax.set_xlabel("ratio bytecheckpoint / peer (black tick: target; green met, red missed, blue no target)")
    ax.set_title("bytecheckpoint vs peers, same run, medians")
    fig.tight_layout()
    fig.savefig(PICTURE, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", default=os.environ.get("BCP_BENCH_QUICK") == "1")
    ap.add_argument("names", nargs="*", help="scripts to run (e.g. bench_s3); default: every bench_*.py")
    ap.add_argument("--ingest", nargs=2, metavar=("NAME", "LOG"), action="append", default=[],
                    help="take script NAME's figures from the output LOG of a run made by hand (runs nothing)")
    args = ap.parse_args(argv)
    os.makedirs(OUT, exist_ok=True)
    store = os.path.join(OUT, "figures.json")
    runs: Dict[str, Any] = {}
    if os.path.exists(store):
        with open(store) as f:
            runs = json.load(f)
    elif os.path.exists(RESULTS):
        runs = from_table(open(RESULTS).read())
    failed = []
    for name, log in args.ingest:
        with open(log) as f:
            text = f.read()
        runs[name] = {"script": name, "exit": 0, "seconds": None, "quick": "--quick" in text[:200],
                      "figures": parse(text), "when": time.strftime("%Y-%m-%d %H:%M"), "ingested": log}
    if args.ingest:  # kept for later runs of other scripts
        with open(store, "w") as f:
            json.dump(runs, f, indent=1)
    for name in ([] if args.ingest else scripts(args.names)):
        result = run(name, args.quick)
        if result["exit"]:
            failed.append(name)
        if result["figures"] or not runs.get(name, {}).get("ingested"):
            runs[name] = result
        else:  # e.g. bench_gpu without a GPU: the figures ingested from a GPU run's log stay
            print(f"({name}: no figures this run; keeping those from {runs[name]['ingested']})")
        with open(store, "w") as f:
            json.dump(runs, f, indent=1)
    runs = {k: v for k, v in runs.items() if os.path.exists(os.path.join(HERE, k + ".py"))}
    write_results(runs)
    draw(runs)
    print("\n" + table(runs))
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
