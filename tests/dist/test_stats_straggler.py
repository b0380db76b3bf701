"""`bytecheckpoint stats` of a real multi-process run names an injected straggler and its phase.

Three gloo ranks save the fault-test state (sync, then async) and load it back; rank 1's pack
writes and rank 2's pack reads are slowed by 1.5 s through the test fault wrapper (BCP_FAULTS).
Normal pack writes and reads take milliseconds here, so the margin over the rule's floor
(max(50 ms, 5% of the operation)) is > 10x even on a loaded machine: deterministic."""
from __future__ import annotations

import json

import pytest

from bytecheckpoint.tools import cli
from launcher import run_ranks

DELAY_S = 1.5
RULES = [{"op": "write", "kind": "slow", "delay_s": DELAY_S, "key": "/pack/", "rank": 1},
         {"op": "read", "kind": "slow", "delay_s": DELAY_S, "key": "/pack/", "rank": 2}]


def stats(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.timeout(300)
def test_stats_names_the_slow_rank_and_phase(tmp_path, capsys):
    outs = run_ranks("scenarios_monitor:straggler_trials", 3, {"root": str(tmp_path)}, timeout=240,
                     extra_env={"BCP_FAULTS": json.dumps(RULES)})
    assert all("TRIALS_OK" in o for o in outs), outs
    for name in ("sync", "async"):
        code, out, _ = stats(capsys, "stats", tmp_path / name, "--json")
        rep = json.loads(out)
        assert code == 0 and rep["ranks"] == [0, 1, 2] and rep["committed"], rep
        assert [(s["rank"], s["phase"]) for s in rep["stragglers"]] == [(1, "write")], (name, rep["stragglers"])
        slow = rep["stragglers"][0]
        assert slow["phase_s"] >= DELAY_S and slow["others_s"] < DELAY_S / 3, slow
        # the others spent rank 1's time waiting for it (a wait phase: never judged)
        assert rep["per_rank"]["0"]["commit.wait"] >= DELAY_S * 0.8, rep["per_rank"]["0"]
    code, out, _ = stats(capsys, "stats", tmp_path / "sync", "--load", "--json")
    rep = json.loads(out)
    assert code == 0 and rep["op"] == "load" and rep["ranks"] == [0, 1, 2] and not rep["stale"], rep
    assert [(s["rank"], s["phase"]) for s in rep["stragglers"]] == [(2, "read")], rep["stragglers"]
    assert rep["per_rank"]["0"]["read.wait"] >= DELAY_S * 0.8   # rank 0 waited for rank 2's reads

    trace = tmp_path / "trace.json"
    code, out, _ = stats(capsys, "stats", tmp_path / "async", "--details", "--trace", trace)
    assert code == 0 and "STRAGGLER rank 1" in out and ": write took" in out and "  write.pack" in out, out
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1, 2}
    packs = [e for e in events if e["ph"] == "X" and e["name"] == "write.pack" and e["pid"] == 1]
    assert packs and max(e["dur"] for e in packs) >= DELAY_S * 1e6 * 0.95
    print(out)  # the closing note quotes a real run (pytest -s)
