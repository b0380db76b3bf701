"""monitor/: the Recorder (threads, caps, off), the record format, logging events, the straggler
rule on synthetic records, the Chrome trace, SaveStats and the adapters' MetricsFeed; inspect's
pure helpers; the record_stats / BCP_LOG_METRICS settings."""
from __future__ import annotations

import json
import logging
import threading
import time

import pytest

import bytecheckpoint as bcp
from bytecheckpoint.catalog.inspect import TensorInfo, fold, natural_key, summarize
from bytecheckpoint.common.options import env_flag
from bytecheckpoint.monitor import (
    LOGGER,
    OFF,
    SCHEMA,
    MetricsFeed,
    Recorder,
    SaveStats,
    analyze,
    chrome_trace,
    parse_record,
    render,
)
from bytecheckpoint.monitor.record import MAX_SPANS_PER_NAME


def test_spans_from_many_threads_are_all_counted_and_the_kept_ones_capped():
    rec = Recorder("save", rank=1, world_size=4, path="p")

    def work():
        for _ in range(1000):
            with rec.span("write.pack", nbytes=3, count=1):
                pass
    threads = [threading.Thread(target=work, name=f"io_{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rec.finish()
    p = rec.phases()["write.pack"]
    assert (p.n, p.bytes, p.count, p.kind) == (4000, 12000, 4000, "detail") and p.busy_s >= 0
    body = rec.to_json()
    assert len(body["spans"]) == MAX_SPANS_PER_NAME and body["dropped_spans"] == 4000 - MAX_SPANS_PER_NAME
    assert body["phases"]["write.pack"]["n"] == 4000
    assert {s[3] for s in body["spans"]} <= {f"io_{i}" for i in range(4)}


def test_off_records_nothing():
    with OFF.span("write"):
        pass
    OFF.add("write", 0.0, 1.0)
    OFF.finish()
    assert not OFF.enabled and OFF.phases() == {} and not OFF.done


def test_wall_clock_anchor_and_integer_microseconds():
    t0 = time.perf_counter()
    rec = Recorder("load", t0=t0)
    assert abs(rec.wall0 - time.time()) < 0.01
    rec.add("read", t0 + 0.001, t0 + 0.003, 10, 1)
    rec.finish()
    body = parse_record(rec.dumps())
    assert body["schema"] == SCHEMA and body["outcome"] == "ok"
    span = body["spans"][0]
    assert span[:3] == ["read", 1000, 2000] and all(isinstance(v, int) for v in span[1:3])
    assert body["phases"]["read"] == {"start_us": 1000, "us": 2000, "busy_us": 2000, "bytes": 10, "count": 1, "n": 1}


@pytest.mark.parametrize("raw,why", [
    (b"{not json", "not JSON"),
    (b"[]", "not a JSON object"),
    (json.dumps({"schema": "other"}).encode(), "is not"),
    (json.dumps({"schema": "bytecheckpoint.stats/9"}).encode(), "newer"),
    (json.dumps({"schema": SCHEMA, "op": "save", "op_id": "", "rank": "1", "world_size": 1, "start_unix": 0,
                 "duration_us": 1, "phases": {}, "spans": []}).encode(), "'rank'"),
])
def test_parse_record_rejects_damage_naming_it(raw, why):
    with pytest.raises(ValueError, match=why):
        parse_record(raw)


def test_logging_events_carry_a_structured_dict(caplog):
    rec = Recorder("save", rank=2, world_size=4, path="/ck", op_id="id1")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        with rec.span("write", nbytes=1 << 20):
            pass
        with rec.span("write.pack"):
            pass
        rec.finish()
    events = [(r.levelno, r.bcp["phase"], r.bcp["event"]) for r in caplog.records]
    assert events == [(logging.DEBUG, "write", "start"), (logging.DEBUG, "write", "end"), (logging.INFO, "", "done")]
    end = caplog.records[1].bcp
    assert end["rank"] == 2 and end["op_id"] == "id1" and end["bytes"] == 1 << 20 and end["duration_s"] >= 0
    assert "save /ck rank 2/4" in caplog.records[2].getMessage()


# ---------------------------------------------------------------------- the straggler rule
def _rec(rank, phases, start=1000.0, total=None, world=4, op="save"):
    """A parsed record with top-level phases {name: seconds}, laid end to end."""
    out, t = {}, 0
    for name, s in phases.items():
        us = int(s * 1e6)
        out[name] = {"start_us": t, "us": us, "busy_us": us, "bytes": 0, "count": 0, "n": 1}
        t += us
    return {"schema": SCHEMA, "op": op, "op_id": "x", "rank": rank, "world_size": world, "host": "h",
            "start_unix": start, "duration_us": int((total or t / 1e6) * 1e6), "outcome": "ok", "phases": out,
            "spans": [[n, p["start_us"], p["us"], "MainThread", 0, 0] for n, p in out.items()], "info": {}}


def _slow(records, world=None):
    rep = analyze(records, world or len(records), path="ck")
    return [(s.rank, s.phase) for s in rep.stragglers], rep


def test_one_slow_writer_among_four_is_named_with_its_phase():
    records = {r: _rec(r, {"walk": 0.01, "write": 1.5 if r == 1 else 0.02, "commit.wait": 0.0 if r == 1 else 1.5})
               for r in range(4)}
    slow, rep = _slow(records)
    assert slow == [(1, "write")]   # the others' long commit.wait (a wait phase) is never judged
    s = rep.stragglers[0]
    assert s.phase_s == 1.5 and s.others_s == 0.02 and s.excess_s == pytest.approx(1.48)
    assert "STRAGGLER rank 1 (h): write took 1.500 s vs 0.020 s" in render(rep)


def test_wait_phases_are_never_judged():
    # the shape of a real 4-rank sync save with rank 1 slow in write: the coordinator waits in
    # commit.wait, ranks 2 and 3 in commit.outcome (2 of the 3 ranks that have it: far above rank 1)
    def phases(r):
        return {"write": 1.5 if r == 1 else 0.02,
                **({"commit.wait": 1.5} if r == 0 else {"commit.outcome": 0.06 if r == 1 else 1.6})}
    slow, rep = _slow({r: _rec(r, phases(r), total=1.7) for r in range(4)})
    assert slow == [(1, "write")], rep.stragglers


def test_two_ranks_compare_with_each_other():
    slow, _ = _slow({0: _rec(0, {"write": 0.02}), 1: _rec(1, {"write": 0.9})})
    assert slow == [(1, "write")]


def test_leave_one_out_medians_match_the_definition_with_ties():
    import random
    import statistics

    from bytecheckpoint.monitor.report import loo_medians
    rng = random.Random(0)
    for n in (1, 2, 3, 4, 5, 8, 33):
        for _ in range(20):
            values = {r: float(rng.choice([0.0, 0.5, 1.0, 2.0, rng.random()])) for r in range(n)}
            want = {r: statistics.median([v for q, v in values.items() if q != r]) for r in values} if n > 1 else {}
            assert loo_medians(values) == want, values


def test_two_ranks_one_twice_the_other_is_judged_against_the_other_alone():
    # a median over both ranks (0.75 s) would hide it: 1.0 < 1.5 x 0.75
    slow, rep = _slow({0: _rec(0, {"write": 0.5}), 1: _rec(1, {"write": 1.0})})
    assert slow == [(1, "write")] and rep.stragglers[0].others_s == 0.5


def test_one_rank_or_all_equal_has_no_straggler():
    assert _slow({0: _rec(0, {"write": 5.0})})[0] == []
    assert _slow({r: _rec(r, {"write": 1.0, "walk": 0.0}) for r in range(5)})[0] == []


@pytest.mark.parametrize("slow_s", [0.028, 0.06])   # 1.4x the others; 3x but under the 50 ms floor
def test_small_differences_are_not_stragglers(slow_s):
    assert _slow({r: _rec(r, {"write": slow_s if r == 0 else 0.02}) for r in range(4)})[0] == []


def test_the_floor_grows_with_the_operation():
    # write 0.6 s vs 0.3 s (2x, 0.3 s more): flagged in a 2 s save, not in a 10 s one (floor 5%: 0.5 s)
    for total, named in ((2.0, [(0, "write")]), (10.0, [])):
        records = {r: _rec(r, {"write": 0.6 if r == 0 else 0.3}, total=total) for r in range(4)}
        assert _slow(records)[0] == named, total


def test_a_phase_on_one_rank_is_shown_not_compared_and_late_arrival_is_flagged():
    records = {r: _rec(r, {"write": 0.02, **({"commit.metadata": 2.0} if r == 0 else {})}, start=1000.0 + (3 if r == 2
                                                                                                          else 0))
               for r in range(3)}
    slow, rep = _slow(records)
    assert slow == [] and [r.phase for r in rep.rows] == ["write", "commit.metadata"]
    assert [(r, round(dt, 3)) for r, dt in rep.late] == [(2, 3.0)]
    assert "LATE rank 2: reached save 3.000 s after" in render(rep)


def test_missing_and_damaged_ranks_are_listed():
    rep = analyze({0: _rec(0, {"write": 0.1})}, 4, path="ck", damaged={2: "not JSON"})
    assert rep.missing == [1, 3] and rep.damaged == {2: "not JSON"}
    text = render(rep)
    assert "missing records: ranks 1, 3" in text and "rank 2: not JSON" in text


def test_chrome_trace_has_a_process_per_rank_and_complete_events():
    records = {r: _rec(r, {"walk": 0.01, "write": 0.5 if r else 0.02}, start=1000.0 + r * 0.01) for r in range(2)}
    rep = analyze(records, 2, path="ck")
    trace = json.loads(json.dumps(chrome_trace(rep)))
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {(0, "rank 0 (h)"), (1, "rank 1 (h) STRAGGLER")}
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 4 and all(e["ts"] >= 0 and e["dur"] >= 0 and e["tid"] == 1 for e in xs)
    write1 = next(e for e in xs if e["pid"] == 1 and e["name"] == "write")
    assert write1["ts"] == pytest.approx(10000 + 10000) and write1["dur"] == 500000


# ---------------------------------------------------------------------- SaveStats and the adapters' feed
class _Handle:
    def __init__(self, is_async):
        self.is_async, self.stats = is_async, SaveStats()


def _finished_handle(is_async, ok=True):
    h = _Handle(is_async)
    rec = Recorder("save")
    h.stats.attach(rec)
    h.stats.update(stall_s=0.01 if is_async else 0.2)
    rec.add("write", rec.perf0, rec.perf0 + 0.1, 4_000_000, 2)
    return h, rec


def test_metrics_feed_sync_at_once_async_stall_then_completion_once():
    feed = MetricsFeed()
    h, rec = _finished_handle(False)
    rec.finish()
    h.stats["total_s"] = 0.2
    m = feed.saved(h, step=5)
    assert set(m) == {"checkpoint/save_stall_s", "checkpoint/save_s", "checkpoint/save_write_s",
                      "checkpoint/save_bytes", "checkpoint/save_mb_s"}
    assert m["checkpoint/save_bytes"] == 4e6 and m["checkpoint/save_mb_s"] == pytest.approx(20.0)
    a, arec = _finished_handle(True)
    assert feed.saved(a, step=6) == {"checkpoint/save_stall_s": 0.01} and feed.ready() == []
    arec.finish()
    ready = feed.ready()
    assert len(ready) == 1 and ready[0]["checkpoint/saved_step"] == 6.0 and "checkpoint/save_s" in ready[0]
    assert a.stats["total_s"] == arec.duration_s and "checkpoint/save_stall_s" not in ready[0]
    assert feed.ready() == []


def test_metrics_feed_never_hands_out_a_completion_before_its_numbers_are_in():
    # the job thread's finish() marks the recorder done, logs, then runs its listeners (SaveStats
    # sets total_s there): the training thread may call ready() in between
    feed, inside, gate = MetricsFeed(), threading.Event(), threading.Event()
    rec = Recorder("save")
    rec.on_finish(lambda r: (inside.set(), gate.wait(10)))   # holds the window open, as a slow log handler would
    h = _Handle(True)
    h.stats.attach(rec)
    h.stats.update(stall_s=0.01)
    rec.add("write", rec.perf0, rec.perf0 + 0.1, 4_000_000, 2)
    feed.saved(h, step=7)
    job = threading.Thread(target=rec.finish)
    job.start()
    assert inside.wait(10)
    try:
        assert not h.stats.done and feed.ready() == []
    finally:
        gate.set()
        job.join()
    (ready,) = feed.ready()
    assert ready["checkpoint/saved_step"] == 7.0 and ready["checkpoint/save_s"] == h.stats["total_s"]


def test_metrics_feed_an_async_save_done_before_it_is_reported_still_names_its_step():
    # a tiny state's async save can complete before the adapter reports it (seen under 3 test workers):
    # its completion goes out at once, with its step, and only once
    feed = MetricsFeed()
    a, rec = _finished_handle(True)
    rec.finish()
    m = feed.saved(a, step=3)
    assert m["checkpoint/saved_step"] == 3.0 and m["checkpoint/save_stall_s"] == 0.01 and "checkpoint/save_s" in m
    assert feed.ready() == []
    b, brec = _finished_handle(True)
    brec.finish(RuntimeError("disk"))
    assert feed.saved(b, step=4) == {"checkpoint/save_stall_s": 0.01}


def test_metrics_feed_drops_failed_saves_and_saves_not_recorded():
    feed = MetricsFeed()
    a, rec = _finished_handle(True)
    feed.saved(a, 1)
    rec.finish(RuntimeError("disk"))
    assert feed.ready() == []
    off = _Handle(True)
    off.stats.update(stall_s=0.5)
    assert feed.saved(off, 2) == {"checkpoint/save_stall_s": 0.5} and feed._pending == []


# ---------------------------------------------------------------------- inspect's helpers, settings
def test_natural_order_groups_and_folding():
    names = ["state/10", "state/2", "state/1/exp_avg", "a1c", "a1b", "x/y", "10"]
    assert sorted(names, key=natural_key) == ["10", "a1b", "a1c", "state/1/exp_avg", "state/2", "state/10", "x/y"]
    tensors = [TensorInfo(n, "float32" if n != "x/y" else "bfloat16", (2,), "replicated", 1, 1, 8) for n in names]
    groups = {g.name: g for g in summarize(tensors, ["epoch", "state/step"])}
    assert [g for g in groups] == ["10", "a1b", "a1c", "epoch", "state", "x"]
    assert (groups["state"].tensors, groups["state"].nbytes, groups["state"].values) == (3, 24, 1)
    assert groups["epoch"].tensors == 0 and groups["epoch"].values == 1
    long = "optimizer_states/0/state/0/model.bert.encoder.layer.10.attention.self.query.weight"
    lines = fold(long, 30)
    assert "".join(line.strip() for line in lines) == long and all(len(line) <= 30 for line in lines)
    assert lines[0].endswith("/") and all(line.startswith("  ") for line in lines[1:])


def test_record_stats_option_and_env():
    assert bcp.Options().record_stats == "all"
    assert bcp.Options.from_env({"BCP_RECORD_STATS": "0"}).record_stats == "off"
    assert bcp.Options.from_env({"BCP_RECORD_STATS": "save"}).record_stats == "save"
    with pytest.raises(bcp.CheckpointError, match="record_stats must be"):
        bcp.Options(record_stats="yes please")
    assert env_flag("BCP_LOG_METRICS", True, {}) and not env_flag("BCP_LOG_METRICS", True, {"BCP_LOG_METRICS": "0"})
    with pytest.raises(bcp.CheckpointError, match="BCP_LOG_METRICS"):
        env_flag("BCP_LOG_METRICS", True, {"BCP_LOG_METRICS": "maybe"})


def test_a_record_beside_a_removed_data_directory_is_dropped_not_an_orphan(tmp_path):
    from bytecheckpoint.storage.posix import PosixStorage
    store = PosixStorage(str(tmp_path), str(tmp_path))
    (tmp_path / "data-1").mkdir()
    assert store.put_aside("data-1/stats/load/rank_0.json", b"{}").result() is True  # stats/load made
    assert (tmp_path / "data-1/stats/load/rank_0.json").read_bytes() == b"{}"
    # the checkpoint was deleted (or overwritten) while a load's record was being finished
    with pytest.raises(Exception):
        store.put_aside("data-2/stats/load/rank_0.json", b"{}").result()
    assert not (tmp_path / "data-2").exists()
