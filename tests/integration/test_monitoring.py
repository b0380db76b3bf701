"""Monitoring end to end on one process: the records a save and a load leave beside the checkpoint,
what `bytecheckpoint stats` makes of them (text, --json, --trace, --plot), that a missing,
damaged or unwritable record never blocks anything, the record_stats switch, delete / keep_last /
verify with records present, and inspect's summary view (quiet on a closed pipe)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.storage import faults
from bytecheckpoint.tools import cli

REPO = Path(__file__).resolve().parents[2]
SAVE_PHASES = {"walk", "arrive", "plan", "write", "commit.wait", "commit.metadata", "commit.outcome"}


def _state(n: int = 4):
    g = torch.Generator().manual_seed(0)
    return {"model": {f"layer{i}.weight": torch.randn(64, 64, generator=g) for i in range(n)}, "epoch": 3}


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _records(path: Path, op: str, ck=None):
    """The record files (written off the operation's path: settled first by wait())."""
    (ck or bcp.default_checkpointer()).wait()
    return sorted(path.glob(f"data-*/stats/{op}/rank_*.json"))


def test_sync_save_record_and_stats_text_json_trace_plot(tmp_path, capsys, monkeypatch):
    path = tmp_path / "ck"
    with bcp.Checkpointer() as ck:
        h = ck.save(path, _state())
        assert ck.last_save_stats is h.stats and h.stats.done and SAVE_PHASES <= set(h.stats.phases)
        assert {"walk_s", "plan_s", "total_s"} <= set(h.stats) and h.stats.record["outcome"] == "ok"
    (rec,) = _records(path, "save")
    assert json.loads(rec.read_text())["op_id"] == bcp.inspect(path).save_id
    code, out, _ = run_cli(capsys, "stats", path)
    assert code == 0 and "(committed), 1 rank(s), records from 1" in out
    assert all(f"\n{p} " in out for p in SAVE_PHASES) and "write.pack" not in out
    code, out, _ = run_cli(capsys, "stats", path, "--details")
    assert "  write.pack " in out and "  write.sync " in out
    code, out, _ = run_cli(capsys, "stats", path, "--json", "--trace", tmp_path / "t.json", "--plot", tmp_path / "p.png")
    rep = json.loads(out)
    assert code == 0 and rep["op"] == "save" and rep["ranks"] == [0] and rep["stragglers"] == []
    assert SAVE_PHASES <= set(rep["per_rank"]["0"])
    trace = json.loads((tmp_path / "t.json").read_text())
    assert any(e["ph"] == "X" and e["name"] == "write" for e in trace["traceEvents"])
    pytest.importorskip("matplotlib")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # not installed
    code, _, err = run_cli(capsys, "stats", path, "--plot", tmp_path / "q.png")
    assert code == 2 and "--plot needs matplotlib" in err and "--trace FILE needs nothing" in err


def test_stats_of_several_checkpoints_one_line_each(tmp_path, capsys):
    for name in ("a", "b"):
        bcp.save(tmp_path / name, _state())
    code, out, err = run_cli(capsys, "stats", tmp_path / "a", tmp_path / "b", tmp_path / "none")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 2 and all("save max " in x and "stragglers: none" in x for x in lines)
    assert "none" in err and "not a bytecheckpoint checkpoint" in err
    code, out, _ = run_cli(capsys, "stats", tmp_path / "a", tmp_path / "b", "--json")
    assert [r["path"] for r in json.loads(out)] == [str(tmp_path / "a"), str(tmp_path / "b")]
    code, _, err = run_cli(capsys, "stats", tmp_path / "a", tmp_path / "b", "--trace", tmp_path / "t.json")
    assert code == 2 and "--trace and --plot take one PATH" in err


@pytest.mark.parametrize("argv", [("stats", "ck", "--top", "-1"), ("inspect", "ck", "--depth", "0"),
                                  ("inspect", "ck", "--depth", "x")])
def test_cli_counts_out_of_range_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(list(argv))
    assert exc.value.code == 2 and "must be an integer >= " in capsys.readouterr().err


def test_async_save_stats_complete_once_done(tmp_path):
    with bcp.Checkpointer(async_save=True) as ck:
        ck.save(tmp_path / "a", _state())        # a second save copies early (the cached plan)
        h = ck.save(tmp_path / "b", _state())
        stall = h.stats.metrics()
        assert set(stall) == {"checkpoint/save_stall_s"}
        h.wait()
        assert h.stats.done and ck.last_save_stats is h.stats
        assert {"copy", "copy_wait", "queue"} | SAVE_PHASES - {"commit.wait", "commit.outcome"} <= set(h.stats.phases)
        assert {"stall_s", "copy_s", "copy_wait_s", "copies_started_early", "total_s"} <= set(h.stats)
        assert h.stats["copies_started_early"] is True
        m = h.stats.metrics()
        assert m["checkpoint/save_s"] == h.stats["total_s"] and m["checkpoint/save_bytes"] == 4 * 64 * 64 * 4
        assert h.stats.record["info"]["stall_us"] == int(h.stats["stall_s"] * 1e6)
    assert len(_records(tmp_path / "b", "save")) == 1


def test_load_record_is_replaced_by_the_next_load(tmp_path, capsys):
    path = tmp_path / "ck"
    h = bcp.save(path, _state())
    assert bcp.last_save_stats is h.stats and h.stats.done
    with bcp.Checkpointer() as ck:
        ck.load(path, _state())
        stats = ck.last_load_stats
        assert {"arrive", "metadata", "plan.load", "read", "read.wait", "objects"} <= set(stats.phases)
        assert stats.total_s > 0 and stats.metrics()["checkpoint/load_bytes"] == 4 * 64 * 64 * 4
        (rec,) = _records(path, "load", ck)
        first = json.loads(rec.read_text())["op_id"]
        ck.load(path, _state())
        ck.wait()
        assert json.loads(rec.read_text())["op_id"] == ck.last_load_stats.record["op_id"] != first
        ck.load_full(path)
        assert "read" in ck.last_load_stats.phases
    code, out, _ = run_cli(capsys, "stats", path, "--load")
    assert code == 0 and "load " in out.splitlines()[0] and "\nread " in out


def test_records_never_block_load_verify_or_save(tmp_path, capsys, caplog):
    path = tmp_path / "ck"
    bcp.save(path, _state())
    (rec,) = _records(path, "save")
    rec.write_bytes(rec.read_bytes()[:40])                 # damaged
    code, out, _ = run_cli(capsys, "stats", path)
    assert code == 0 and "damaged records: rank 0: not JSON" in out
    out_state = _state()
    bcp.load(path, out_state)
    assert bcp.verify(path).ok
    for d in path.glob("data-*/stats"):                     # gone altogether
        for f in d.rglob("*.json"):
            f.unlink()
    code, _, err = run_cli(capsys, "stats", path)
    assert code == 2 and "no save records" in err
    assert bcp.verify(path).ok
    # a store that refuses the records: the save and the load go on, a DEBUG line says so
    with caplog.at_level(logging.DEBUG, logger="bytecheckpoint.monitor"), bcp.Checkpointer() as ck:
        with faults.inject({"op": "write", "kind": "denied", "key": "/stats/"}, checkpointer=ck):
            ck.save(tmp_path / "denied", _state())
            ck.load(tmp_path / "denied", _state())
            ck.wait()  # records are written off the operation's path: settled here (and at close)
    assert not _records(tmp_path / "denied", "save") and not _records(tmp_path / "denied", "load")
    assert sum("stats record" in r.getMessage() for r in caplog.records) == 2


def test_record_stats_save_and_off(tmp_path):
    with bcp.Checkpointer(record_stats="save") as ck:
        ck.save(tmp_path / "s", _state())
        ck.load(tmp_path / "s", _state())
        assert ck.last_load_stats.phases and not _records(tmp_path / "s", "load", ck)   # in memory only
        assert len(_records(tmp_path / "s", "save", ck)) == 1
    with bcp.Checkpointer(record_stats="all", async_save=True) as ck:
        recorded = set(ck.save(tmp_path / "a", _state()).wait().stats)
    with bcp.Checkpointer(record_stats="off", async_save=True) as ck:
        h = ck.save(tmp_path / "o", _state()).wait()
        ck.load(tmp_path / "o", _state())
        assert not list((tmp_path / "o").glob("data-*/stats"))
        # the inline numbers only (other features add their own): recording's one key is an async save's total_s
        assert "total_s" in recorded and set(h.stats) == recorded - {"total_s"}
        assert {"walk_s", "plan_s", "copies_started_early", "copy_s", "copy_wait_s", "stall_s"} <= set(h.stats)
        assert h.stats.phases == {} and ck.last_load_stats.total_s is None


def test_failed_save_is_reported_not_committed(tmp_path, capsys):
    path = tmp_path / "ck"
    with bcp.Checkpointer() as ck:
        with faults.inject({"op": "write", "kind": "enospc", "key": "/pack/"}, checkpointer=ck):
            with pytest.raises(bcp.CheckpointError):
                ck.save(path, _state())
    code, out, _ = run_cli(capsys, "stats", path)
    assert code == 2 and "NOT COMMITTED" in out and "rank 0: error: " in out


def test_delete_keep_last_and_export_with_records(tmp_path):
    run = tmp_path / "run"
    for step in range(3):
        bcp.save(run / f"step_{step}", _state(), step=step)
        bcp.load(run / f"step_{step}", _state())
    report = bcp.keep_last(run, 1)
    assert len(report.deleted) == 2 and sorted(os.listdir(run)) == ["step_2"]
    assert bcp.verify(run / "step_2").ok and _records(run / "step_2", "load")
    from bytecheckpoint.tools.export import export_safetensors
    result = export_safetensors(str(run / "step_2"), str(tmp_path / "hf"), key="model")
    assert result.tensors == 4
    bcp.delete(run / "step_2")
    assert not (run / "step_2").exists()


def test_loads_over_http_write_nothing_and_stats_reads_per_rank(tmp_path, capsys):
    import functools
    import http.server
    import threading

    bcp.save(tmp_path / "ck", _state())
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/ck"
        with bcp.Checkpointer() as ck:
            ck.load(url, _state())
            assert "read" in ck.last_load_stats.phases
        assert not _records(tmp_path / "ck", "load")
        code, out, _ = run_cli(capsys, "stats", url)   # no listing over http: each rank's record by name
        assert code == 0 and "records from 1" in out
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------- inspect
@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A Lightning-shaped checkpoint: 40 layers in two groups, plain values, long names."""
    path = tmp_path_factory.mktemp("wide") / "ck"
    state = {"state_dict": {f"model.encoder.layer.{i}.attention.self.query.weight": torch.zeros(8, 8)
                            for i in range(20)},
             "optimizer_states": [{"state": {str(i): {"exp_avg": torch.zeros(8, 8)} for i in range(20)}}],
             "epoch": 1, "loops": {"fit_loop": {"step": 4}}}
    bcp.save(path, state, step=4)
    return path


def test_inspect_summary_groups_first(wide, capsys):
    code, out, _ = run_cli(capsys, "inspect", wide)
    lines = out.splitlines()
    assert code == 0 and "saved by 1 rank(s) at step 4, 40 tensors" in lines[0]
    assert lines[2].split() == ["group", "tensors", "bytes", "dtypes", "layout", "values"]
    assert lines[3].split()[:2] == ["optimizer_states", "20"] and lines[4].split()[:2] == ["state_dict", "20"]
    assert "plain values (rank 0: " in out and "epoch, loops" in out
    assert "largest tensors:" in out and "--all lists every one" in out and len(lines) < 20


def test_inspect_all_in_natural_order_folded_or_wide(wide, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    code, out, _ = run_cli(capsys, "inspect", wide, "--all")
    names = [line.split()[0] for line in out.splitlines()[2:] if line.startswith("optimizer_states/")]
    assert names == [f"optimizer_states/0/state/{i}/exp_avg" for i in range(20)]   # 2 before 10
    assert max(len(line) for line in out.splitlines()[1:]) <= 100   # the header holds the path
    assert "\n  attention.self.query.weight" in out or "\n  self.query.weight" in out   # folded at a '.'
    code, out, _ = run_cli(capsys, "inspect", wide, "--all", "--wide")
    assert "model.encoder.layer.10.attention.self.query.weight  float32" in out
    code, out, _ = run_cli(capsys, "inspect", wide, "--group", "optimizer_states", "--wide")
    assert code == 0 and "state_dict/" not in out and out.count("exp_avg") == 20
    code, _, err = run_cli(capsys, "inspect", wide, "--group", "nope")
    assert code == 2 and "no key under 'nope'; groups: epoch, loops, optimizer_states, state_dict" in err


def test_inspect_quiet_on_a_closed_pipe(tmp_path):
    path = tmp_path / "many"
    bcp.save(path, {"w": {str(i): torch.zeros(1) for i in range(1500)}})   # > 64 KiB of --all output
    env = dict(os.environ, PYTHONPATH=str(REPO / "core" / ".."), COLUMNS="120")
    r = subprocess.run(f"{sys.executable} -m bytecheckpoint inspect {path} --all | head -1; "
                       "exit ${PIPESTATUS[0]}", shell=True, executable="/bin/bash", capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 141 and r.stderr == "" and r.stdout.startswith(str(path)), (r.returncode, r.stderr)
