"""Every rank's record of one save or load -> the per-phase table, the stragglers, a Chrome /
Perfetto trace. Pure functions over parsed records (monitor.record.parse_record); reading them
from storage is catalog/stats.py's, printing the CLI's.

The straggler rule (work phases only; wait phases are where the others spent a straggler's time):
a rank is slow in a work phase when it took more than RATIO x the median of the *other* ranks
there (leave-one-out: with 2 ranks, the other one) AND more than the floor
max(FLOOR_S, FLOOR_FRACTION x the median operation time) longer. A straggler is named with the
phase of its largest excess. A rank that started the operation more than the floor after the
others is LATE (training imbalance, not storage; it relies on the hosts' clocks agreeing).
"""
from __future__ import annotations

import bisect
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .record import PHASES, human_bytes, kind_of

RATIO = 1.5
FLOOR_S = 0.05
FLOOR_FRACTION = 0.05
MAX_SHOWN = 8


@dataclass
class PhaseRow:
    phase: str
    kind: str                            # work | wait | detail
    ranks: int                           # ranks that have the phase
    median_s: float
    max_s: float
    slowest: List[Tuple[int, float]]     # (rank, seconds), slowest first
    bytes: int                           # over all ranks
    mb_s: Optional[float] = None         # median over ranks of bytes / seconds


@dataclass
class Straggler:
    rank: int
    phase: str                           # the phase of its largest excess
    phase_s: float
    others_s: float                      # the other ranks' median in that phase
    excess_s: float                      # summed over every work phase where it was above the others
    host: str = ""


@dataclass
class StatsReport:
    path: str
    op: str                              # save | load
    op_id: str
    world_size: int
    committed: bool = True               # save: metadata.json names this save
    ranks: List[int] = field(default_factory=list)          # ranks with a usable record
    missing: List[int] = field(default_factory=list)
    damaged: Dict[int, str] = field(default_factory=dict)
    stale: List[Tuple[str, List[int]]] = field(default_factory=list)   # (earlier load id, its ranks)
    failed: Dict[int, str] = field(default_factory=dict)    # rank -> outcome, where not ok
    start_unix: float = 0.0
    median_s: float = 0.0
    max_s: float = 0.0
    stall_median_s: Optional[float] = None
    stall_max_s: Optional[float] = None
    floor_s: float = FLOOR_S
    rows: List[PhaseRow] = field(default_factory=list)
    stragglers: List[Straggler] = field(default_factory=list)
    late: List[Tuple[int, float]] = field(default_factory=list)       # (rank, seconds after the others)
    records: Dict[int, Dict[str, Any]] = field(default_factory=dict, repr=False)

    def to_dict(self) -> Dict[str, Any]:
        """JSON form (`stats --json`): everything but the raw records, plus each rank's phase seconds."""
        out = asdict(replace(self, records={}))   # asdict would deep-copy every record's spans first
        out.pop("records")
        out["per_rank"] = {str(r): {n: p["us"] / 1e6 for n, p in rec["phases"].items()}
                           for r, rec in sorted(self.records.items())}
        return out


def phase_seconds(rec: Dict[str, Any], phase: str) -> Optional[float]:
    p = rec["phases"].get(phase)
    return None if p is None else p["us"] / 1e6


def loo_medians(values: Dict[int, float]) -> Dict[int, float]:
    """Each rank's leave-one-out median: the median of the *other* ranks' values (none for a rank
    alone). One sort for all ranks, O(W log W): at thousands of ranks, a median per rank would be
    O(W^2 log W) (seconds at 2048 ranks)."""
    s = sorted(values.values())
    m = len(s) - 1                           # the others of each rank
    if m < 1:
        return {}
    out: Dict[int, float] = {}
    for r, v in values.items():
        i = bisect.bisect_left(s, v)          # leaving out any copy of v leaves the same others
        hi = s[m // 2] if m // 2 < i else s[m // 2 + 1]
        if m % 2:
            out[r] = hi
        else:
            lo = s[m // 2 - 1] if m // 2 - 1 < i else s[m // 2]
            out[r] = (lo + hi) / 2
    return out


def _order(names: Sequence[str], records: Dict[int, Dict[str, Any]]) -> List[str]:
    """Top-level phases in pipeline order, each followed by its details (by first start)."""
    top = [n for n in PHASES if n in names]
    first = {n: min(rec["phases"][n]["start_us"] for rec in records.values() if n in rec["phases"]) for n in names}
    out: List[str] = []
    details = sorted((n for n in names if n not in PHASES), key=lambda n: (first[n], n))
    placed = set()
    for t in top:
        out.append(t)
        for d in details:
            if parent_of(d) == t:
                out.append(d)
                placed.add(d)
    out += [d for d in details if d not in placed]
    return out


def parent_of(name: str) -> Optional[str]:
    """The top-level phase a detail belongs to ("write.pack" -> "write"), or None."""
    parts = name.split(".")
    for k in range(len(parts) - 1, 0, -1):
        cand = ".".join(parts[:k])
        if cand in PHASES:
            return cand
    return None


def analyze(records: Dict[int, Dict[str, Any]], world_size: int, *, path: str = "", op: str = "",
            op_id: str = "", damaged: Optional[Dict[int, str]] = None, stale=(), committed: bool = True,
            top: int = 3) -> StatsReport:
    ranks = sorted(records)
    damaged = dict(damaged or {})
    any_rec = records[ranks[0]] if ranks else {}
    rep = StatsReport(path, op or any_rec.get("op", "?"), op_id or any_rec.get("op_id", ""), world_size,
                      committed, ranks, [r for r in range(world_size) if r not in records and r not in damaged],
                      damaged, list(stale), records=records)
    rep.failed = {r: rec.get("outcome", "?") for r, rec in records.items() if rec.get("outcome") != "ok"}
    if not ranks:
        return rep
    totals = {r: records[r]["duration_us"] / 1e6 for r in ranks}
    rep.median_s, rep.max_s = statistics.median(totals.values()), max(totals.values())
    rep.start_unix = min(records[r]["start_unix"] for r in ranks)
    stalls = [records[r]["info"]["stall_us"] / 1e6 for r in ranks
              if isinstance(records[r].get("info", {}).get("stall_us"), int)]
    if stalls:
        rep.stall_median_s, rep.stall_max_s = statistics.median(stalls), max(stalls)
    rep.floor_s = floor = max(FLOOR_S, FLOOR_FRACTION * rep.median_s)
    names = {n for r in ranks for n in records[r]["phases"]}
    per_phase: Dict[str, Dict[int, float]] = {}
    for n in _order(list(names), records):
        d = {r: s for r in ranks if (s := phase_seconds(records[r], n)) is not None}
        per_phase[n] = d
        nbytes = {r: records[r]["phases"][n].get("bytes", 0) for r in d}
        rates = [nbytes[r] / d[r] / 1e6 for r in d if nbytes[r] and d[r] > 0]
        rep.rows.append(PhaseRow(n, kind_of(n), len(d), statistics.median(d.values()), max(d.values()),
                                 sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))[:top], sum(nbytes.values()),
                                 statistics.median(rates) if rates else None))
    judged = {n: (d, loo_medians(d)) for n, d in per_phase.items() if kind_of(n) == "work" and len(d) >= 2}
    for r in ranks:
        excess, worst = 0.0, None
        for n, (d, loo) in judged.items():
            if r not in d:
                continue
            med = loo[r]
            over = d[r] - med
            excess += max(0.0, over)
            if d[r] > RATIO * med and over > floor and (worst is None or over > worst[3]):
                worst = (n, d[r], med, over)
        if worst is not None:
            rep.stragglers.append(Straggler(r, worst[0], worst[1], worst[2], excess, records[r].get("host", "")))
    rep.stragglers.sort(key=lambda s: (-s.excess_s, s.rank))
    starts = {r: records[r]["start_unix"] for r in ranks}
    for r, med in sorted(loo_medians(starts).items()):
        if starts[r] - med > floor:
            rep.late.append((r, starts[r] - med))
    return rep


# ---------------------------------------------------------------------- text

def _s(x: float) -> str:
    return f"{x:.3f} s" if x < 100 else f"{x:.0f} s"


def _ranks(rs: Sequence[int], n: int = 16) -> str:
    return ", ".join(map(str, rs[:n])) + (f" ... ({len(rs)})" if len(rs) > n else "")


def render(rep: StatsReport, *, details: bool = False) -> str:
    state = "" if rep.op != "save" else (" (committed)" if rep.committed else
                                         " (NOT COMMITTED: the save failed or is still running)")
    lines = [f"{rep.path}: {rep.op} {rep.op_id}{state}, {rep.world_size} rank(s), records from {len(rep.ranks)}"]
    if rep.missing:
        lines.append(f"missing records: ranks {_ranks(rep.missing)}")
    if rep.damaged:
        lines.append("damaged records: " + "; ".join(f"rank {r}: {why}" for r, why in
                                                     sorted(rep.damaged.items())[:MAX_SHOWN]))
    for op_id, rs in rep.stale:
        lines.append(f"stale: {len(rs)} record(s) of an earlier load {op_id} ignored (ranks {_ranks(rs, 8)})")
    for r, outcome in sorted(rep.failed.items())[:MAX_SHOWN]:
        lines.append(f"rank {r}: {outcome}")
    if not rep.ranks:
        return "\n".join(lines)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(rep.start_unix))
    stall = (f"; stall median {_s(rep.stall_median_s)}, max {_s(rep.stall_max_s)}"
             if rep.stall_median_s is not None else "")
    lines.append(f"started {started}; time per rank: median {_s(rep.median_s)}, max {_s(rep.max_s)}{stall}")
    lines.append("")
    rows = [("phase", "kind", "ranks", "median", "max", "slowest ranks (s)", "bytes", "MB/s")]
    for p in rep.rows:
        if p.kind == "detail" and not details:
            continue
        name = ("  " + p.phase) if p.kind == "detail" else p.phase
        rows.append((name, p.kind, str(p.ranks), _s(p.median_s), _s(p.max_s),
                     ", ".join(f"{r} ({v:.3f})" for r, v in p.slowest), human_bytes(p.bytes) if p.bytes else "",
                     f"{p.mb_s:.0f}" if p.mb_s is not None and p.kind != "wait" and p.bytes >= 1 << 20 else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.append("")
    for s in rep.stragglers[:MAX_SHOWN]:
        host = f" ({s.host})" if s.host else ""
        lines.append(f"STRAGGLER rank {s.rank}{host}: {s.phase} took {_s(s.phase_s)} vs {_s(s.others_s)} on the "
                     f"other ranks (median); {_s(s.excess_s)} over them in all")
    if len(rep.stragglers) > MAX_SHOWN:
        lines.append(f"... and {len(rep.stragglers) - MAX_SHOWN} more stragglers (--json lists them all)")
    if not rep.stragglers:
        lines.append("no straggler" + (f" (no rank took > {RATIO}x the others' median and > {rep.floor_s:.2f} s "
                                       f"more in a work phase)" if len(rep.ranks) > 1 else " (one rank: nothing "
                                                                                             "to compare)"))
    for r, dt in rep.late[:MAX_SHOWN]:
        lines.append(f"LATE rank {r}: reached {rep.op} {_s(dt)} after the other ranks (median)")
    return "\n".join(lines)


def render_many(reports: Sequence[StatsReport]) -> str:
    """One line per checkpoint, then the ranks that were stragglers more than once."""
    lines, counts, phases = [], {}, {}
    for rep in reports:
        slow = ", ".join(f"rank {s.rank} {s.phase} +{s.excess_s:.2f} s" for s in rep.stragglers[:3]) or "none"
        if not rep.ranks:
            lines.append(f"{rep.path}: no records")
            continue
        stall = f", stall {_s(rep.stall_max_s)}" if rep.stall_max_s is not None else ""
        lines.append(f"{rep.path}: {rep.op} max {_s(rep.max_s)}{stall}; stragglers: {slow}")
        for s in rep.stragglers:
            counts[s.rank] = counts.get(s.rank, 0) + 1
            phases.setdefault(s.rank, {}).setdefault(s.phase, 0)
            phases[s.rank][s.phase] += 1
    repeat = sorted(((n, r) for r, n in counts.items() if n > 1), reverse=True)
    if repeat:
        lines.append("")
        for n, r in repeat[:MAX_SHOWN]:
            top = max(phases[r].items(), key=lambda kv: kv[1])[0]
            lines.append(f"repeat offender: rank {r} slow in {n} of {len(reports)} ({top})")
    return "\n".join(lines)


# ---------------------------------------------------------------------- Chrome / Perfetto trace

def chrome_trace(rep: StatsReport) -> Dict[str, Any]:
    """Trace Event Format (ui.perfetto.dev, chrome://tracing): one process per rank (pid = rank),
    one thread per recording thread, an "X" event per kept span; µs from the earliest start."""
    records = rep.records
    events: List[Dict[str, Any]] = []
    if not records:
        return {"traceEvents": events}
    t0 = min(rec["start_unix"] for rec in records.values())
    dropped = 0
    for r in sorted(records):
        rec = records[r]
        base = (rec["start_unix"] - t0) * 1e6
        slow = " STRAGGLER" if any(s.rank == r for s in rep.stragglers) else ""
        events.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0,
                       "args": {"name": f"rank {r} ({rec.get('host', '?')}){slow}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}})
        tids: Dict[str, int] = {}
        for name, start, dur, thread, nbytes, count in rec["spans"]:
            thread = str(thread)
            if thread not in tids:
                tids[thread] = len(tids) + 1
                events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": tids[thread],
                               "args": {"name": thread}})
            events.append({"name": name, "cat": f"{rec['op']},{kind_of(name)}", "ph": "X", "pid": r,
                           "tid": tids[thread], "ts": round(base + start, 1), "dur": float(dur),
                           "args": {"bytes": nbytes, "count": count}})
        dropped += int(rec.get("dropped_spans", 0))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"op": rep.op, "op_id": rep.op_id, "path": rep.path, "start_unix": t0,
                          "dropped_spans": dropped}}
