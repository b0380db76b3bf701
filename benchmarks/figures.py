"""The convention every `benchmarks/bench_*.py` follows so that `run_all.py` collects its figures.

A figure is one comparison: bytecheckpoint against a peer measured in the same run. A script
reports each figure as one line on stdout:

    FIGURE {"figure": "...", "bcp": 1.23, "peer": 2.34, "ratio": 0.53, "target": "<= 0.8", ...}

Keys: `figure` (what was measured, unique within the script), `bcp` and `peer` (medians, in
`unit`), `ratio` (= bcp / peer), `target` ("<= x" or ">= x" on the ratio, or "" for a figure shown
without a target), and optional `unit` ("s" by default; "MiB/s" for throughputs), `peer_name`
(what the peer is) and `note`. `figure(...)` below prints such a line and returns the row;
`parse(text)` reads them back. A script also accepts `--quick` (a smaller, faster run that
prints the same figures); run_all.py passes it with `--quick` and sets BCP_BENCH_QUICK=1.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Dict, List, Optional, Tuple

PREFIX = "FIGURE "


def figure(name: str, bcp: float, peer: float, target: str = "", *, unit: str = "s", peer_name: str = "",
           note: str = "", emit: bool = True) -> Dict[str, Any]:
    ratio = bcp / peer if peer else float("nan")
    row = {"figure": name, "bcp": round(float(bcp), 4), "peer": round(float(peer), 4),
           "ratio": round(ratio, 3) if math.isfinite(ratio) else None, "target": target, "unit": unit,
           "peer_name": peer_name, "note": note}
    if emit:
        print(PREFIX + json.dumps(row), flush=True)
    return row


def parse(text: str) -> List[Dict[str, Any]]:
    rows = []
    for line in text.splitlines():
        if line.startswith(PREFIX):
            try:
                row = json.loads(line[len(PREFIX):])
            except ValueError:
                continue
            if isinstance(row, dict) and {"figure", "bcp", "peer", "ratio", "target"} <= set(row):
                rows.append(row)
    return rows


def met(row: Dict[str, Any]) -> Optional[bool]:
    """True/False against the target, None for a figure without one (or without a ratio)."""
    bound = target_bound(row.get("target") or "")
    if bound is None or row.get("ratio") is None:
        return None
    op, limit = bound
    return row["ratio"] <= limit if op == "<=" else row["ratio"] >= limit


def target_bound(target: str) -> Optional[Tuple[str, float]]:
    """("<=" or ">=", limit) of a target such as "<= 0.8" (or "<= 0.8x"); None if it is not one."""
    m = re.fullmatch(r"\s*(<=|>=)\s*([0-9.]+)\s*x?\s*", target)
    return (m.group(1), float(m.group(2))) if m else None
