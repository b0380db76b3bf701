"""`bytecheckpoint stats --plot FILE`: every rank's phases on a shared wall-clock axis (a Gantt
chart). matplotlib is imported here only, when a picture is asked for."""
from __future__ import annotations

from .record import PHASES, kind_of
from .report import StatsReport

WAIT_HATCHES = ("//", "\\\\", "xx", "..", "--", "++", "oo")
NEEDS_MATPLOTLIB = ("--plot needs matplotlib (pip install matplotlib); --trace FILE needs nothing (open it in "
                    "https://ui.perfetto.dev)")


def plot(rep: StatsReport, out: str, max_ranks: int = 64) -> None:
    """One bar per rank, its top-level phases as coloured segments (wait phases light and hatched),
    stragglers' labels in red; the format follows the file name (png, svg, pdf). Raises
    RuntimeError when matplotlib is missing. Beyond `max_ranks` ranks, the slowest are drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(NEEDS_MATPLOTLIB) from None
    records = rep.records
    if not records:
        raise ValueError(f"{rep.path}: no records to plot")
    ranks = sorted(records)
    if len(ranks) > max_ranks:
        keep = sorted(ranks, key=lambda r: -records[r]["duration_us"])[:max_ranks]
        ranks = sorted(keep)
    t0 = min(records[r]["start_unix"] for r in ranks)
    top = [p for p in PHASES if any(p in records[r]["phases"] for r in ranks)]
    # work phases in distinct colours; wait phases light grey, told apart by their hatching
    work = [p for p in top if kind_of(p) == "work"]
    wait = [p for p in top if kind_of(p) != "work"]
    colors = {p: plt.get_cmap("tab10")(i % 10) for i, p in enumerate(work)}
    colors.update({p: "#d0d0d0" for p in wait})
    hatches = {p: WAIT_HATCHES[i % len(WAIT_HATCHES)] for i, p in enumerate(wait)}
    fig, ax = plt.subplots(figsize=(11, max(2.6, 1.3 + 0.42 * len(ranks))))
    for y, r in enumerate(ranks):
        rec = records[r]
        off = rec["start_unix"] - t0
        for p in top:
            ph = rec["phases"].get(p)
            if ph is None:
                continue
            ax.barh(y, ph["us"] / 1e6, left=off + ph["start_us"] / 1e6, color=colors[p], height=0.7,
                    hatch=hatches.get(p), edgecolor="#808080" if p in hatches else "white", linewidth=0.3)
    slow = {s.rank: s for s in rep.stragglers}
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" + (f"  ({slow[r].phase})" if r in slow else "") for r in ranks])
    for label, r in zip(ax.get_yticklabels(), ranks):
        if r in slow:
            label.set_color("red")
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first rank started")
    ax.set_title(f"{rep.op} {rep.op_id}: where each rank's time went" +
                 (f" (straggler: rank {', '.join(map(str, slow))})" if slow else ""), fontsize="medium")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, facecolor=colors[p], hatch=hatches.get(p),
                                     edgecolor="#808080" if p in hatches else colors[p]) for p in top],
              labels=[f"{p} ({kind_of(p)})" for p in top], fontsize="small", loc="upper left",
              bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
