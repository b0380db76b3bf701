"""Where one rank's save or load time went: a Recorder per operation and rank.

A Recorder holds spans (name, perf_counter start/end, thread, bytes, count). Every thread of the
operation (the caller, the async save's job thread, I/O workers) records without a lock: a span
is one tuple appended to a list (atomic). Wall-clock placement comes from one anchor taken when
the recorder is made (time.time() at the call's perf_counter start), so ranks line up on wall
clock. At the end the record is folded per phase name and serialised (integer microseconds), and
written beside the checkpoint by `write_record` (never part of what makes it committed).

Python logging, on the logger "bytecheckpoint.monitor" (no handler is added): DEBUG at the
start and end of every top-level phase (PHASES), INFO at the end of each operation. Each event
carries `record.bcp`, a dict (op, op_id, path, rank, world_size, phase, event, start_unix,
duration_s, bytes, count, thread) for structured handlers.

The standard library only: every layer above may record.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

LOGGER = "bytecheckpoint.monitor"
log = logging.getLogger(LOGGER)

SCHEMA = "bytecheckpoint.stats/1"
MAX_SPANS_PER_NAME = 64      # spans kept individually per name in a record; the rest only in the totals

# Top-level phases in pipeline order: name -> (kind, meaning). "work": this rank's own effort (a
# rank far above the others there is a straggler); "wait": waiting for peers or an earlier save
# (where the other ranks spend a straggler's excess). Names not listed here are details
# ("write.pack", "read.io", ...), shown under their parent and never judged.
PHASES: Dict[str, Tuple[str, str]] = {
    # save, caller thread
    "walk": ("work", "state walked: tensors flattened, plain values encoded"),
    "arrive": ("wait", "waiting for every rank to call save"),
    "plan": ("wait", "save plan agreed (cached: one all-reduce; new: gather, plan, scatter)"),
    "copy": ("work", "async: state copied into a staging slot"),
    "copy_wait": ("work", "async: waiting for the staging copies to land"),
    # save, job thread (async) or caller thread (sync)
    "queue": ("wait", "async: waiting for the copies to land and the previous save's job"),
    "write": ("work", "chunks encoded, checksummed, written into pack files, fsynced"),
    "commit.wait": ("wait", "waiting for every rank's write result"),
    "commit.metadata": ("work", "coordinator: metadata.json (the commit point) written"),
    "commit.outcome": ("wait", "waiting for the commit's outcome"),
    # load
    "metadata": ("wait", "metadata read by the coordinator and shared"),
    "plan.load": ("work", "state flattened, keys checked, reads planned"),
    "plan.load.wait": ("wait", "waiting for every rank's plan"),
    "share.plan": ("wait", "zero-redundancy: who reads which shared chunk"),
    "read": ("work", "chunks read, checked and copied into the state"),
    "read.wait": ("wait", "waiting for every rank's reads"),
    "exchange": ("work", "zero-redundancy: shared chunks read once and broadcast"),
    "values": ("work", "plain values read and checked against the template (before any tensor is written)"),
    "objects": ("work", "plain values assigned, finalizers run"),
    "values.wait": ("wait", "waiting for every rank's plain values"),
    "objects.wait": ("wait", "waiting for every rank's finalizers"),
}


def kind_of(name: str) -> str:
    return PHASES.get(name, ("detail", ""))[0]


def new_op_id() -> str:
    """An id for one operation (a load's, chosen by the coordinator; a save's is its save id)."""
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]


@dataclass(frozen=True)
class Phase:
    """One phase of one rank's operation, all its spans folded."""
    name: str
    kind: str                  # work | wait | detail
    start_s: float             # from the operation's start
    seconds: float             # first start -> last end
    busy_s: float              # sum of the spans (> seconds when they ran in parallel)
    bytes: int
    count: int
    n: int                     # spans

    @property
    def mb_s(self) -> Optional[float]:
        return self.bytes / self.seconds / 1e6 if self.bytes and self.seconds > 0 else None


class _Span:
    __slots__ = ("rec", "name", "nbytes", "count", "t0")

    def __init__(self, rec: "Recorder", name: str, nbytes: int, count: int):
        self.rec, self.name, self.nbytes, self.count = rec, name, nbytes, count

    def __enter__(self) -> "_Span":
        if self.name in PHASES and log.isEnabledFor(logging.DEBUG):
            self.rec._log_phase(self.name, "start", time.perf_counter(), None, 0, 0)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.rec.add(self.name, self.t0, time.perf_counter(), self.nbytes, self.count)


class _NoSpan:
    __slots__ = ("nbytes", "count")

    def __enter__(self) -> "_NoSpan":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


_NOSPAN = _NoSpan()


class Recorder:
    """One rank's record of one save or load. span()/add() are safe from any thread."""

    enabled = True

    def __init__(self, op: str, *, rank: int = 0, world_size: int = 1, path: str = "", op_id: str = "",
                 t0: Optional[float] = None, sink: Optional["AsideWrites"] = None):
        self.op, self.rank, self.world_size, self.path, self.op_id = op, rank, world_size, path, op_id
        self.perf0 = time.perf_counter() if t0 is None else t0
        self.wall0 = time.time() - (time.perf_counter() - self.perf0)
        self.sink = sink
        self.info: Dict[str, Any] = {}
        self.outcome: Optional[str] = None
        self.end: Optional[float] = None
        self._spans: List[tuple] = []
        self._threads: Dict[int, str] = {}
        self._listeners: List[Callable[["Recorder"], None]] = []
        self.self_s = 0.0          # the recorder's own cost at the end (folding, serialising, writing)

    # ------------------------------------------------------------ recording
    def span(self, name: str, nbytes: int = 0, count: int = 0) -> _Span:
        """`with rec.span("write", nbytes=n):` (set .nbytes / .count inside when known only then)."""
        return _Span(self, name, nbytes, count)

    def add(self, name: str, t0: float, t1: float, nbytes: int = 0, count: int = 0) -> None:
        """A span timed elsewhere (perf_counter values)."""
        tid = threading.get_ident()
        if tid not in self._threads:
            self._threads.setdefault(tid, threading.current_thread().name)
        self._spans.append((name, t0, t1, tid, nbytes, count))
        if name in PHASES and log.isEnabledFor(logging.DEBUG):
            self._log_phase(name, "end", t0, t1, nbytes, count)

    def set(self, **info: Any) -> None:
        self.info.update(info)

    def on_finish(self, fn: Callable[["Recorder"], None]) -> None:
        if self.end is not None:
            fn(self)
        else:
            self._listeners.append(fn)

    def finish(self, error: Optional[BaseException] = None) -> None:
        """The operation ended on this rank (ok, or with `error`); logs the INFO summary once."""
        if self.end is not None:
            return
        self.end = time.perf_counter()
        self.outcome = "ok" if error is None else f"error: {type(error).__name__}"
        if log.isEnabledFor(logging.INFO):
            self._log_summary(error)
        for fn in self._listeners:
            try:
                fn(self)
            except Exception:  # noqa: BLE001 - a listener never fails the operation
                log.debug("stats listener failed", exc_info=True)

    # ------------------------------------------------------------ reading
    @property
    def done(self) -> bool:
        return self.end is not None

    @property
    def duration_s(self) -> float:
        return (self.end if self.end is not None else time.perf_counter()) - self.perf0

    def phases(self) -> Dict[str, Phase]:
        """Every span folded per name (all of them, not only the ones a record keeps)."""
        p0 = self.perf0
        return {n: Phase(n, kind_of(n), a[0] - p0, a[1] - a[0], a[2], a[3], a[4], a[5])
                for n, a in self._fold(keep=False)[0].items()}

    def _fold(self, keep: bool) -> Tuple[Dict[str, list], List[list], int]:
        """One pass over a snapshot of the spans (other threads may still append): per name
        [first start, last end, busy, bytes, count, spans]; with `keep`, also the spans a record
        keeps (MAX_SPANS_PER_NAME per name, times in µs from the start) and how many it drops."""
        p0, threads = self.perf0, self._threads
        acc: Dict[str, list] = {}
        kept: List[list] = []
        dropped = 0
        for name, t0, t1, tid, nbytes, count in list(self._spans):
            a = acc.get(name)
            if a is None:
                a = acc[name] = [t0, t1, t1 - t0, nbytes, count, 1]
            else:
                if t0 < a[0]:
                    a[0] = t0
                if t1 > a[1]:
                    a[1] = t1
                a[2] += t1 - t0
                a[3] += nbytes
                a[4] += count
                a[5] += 1
            if not keep:
                continue
            if a[5] > MAX_SPANS_PER_NAME:
                dropped += 1
            else:
                kept.append([name, round((t0 - p0) * 1e6), round((t1 - t0) * 1e6), threads.get(tid, str(tid)),
                             nbytes, count])
        return acc, kept, dropped

    def to_json(self) -> Dict[str, Any]:
        """The record (integer µs from start_unix), folded in one pass without Phase objects: it
        is on the operation's path (benchmarks/bench_monitoring.py)."""
        p0 = self.perf0
        acc, spans, dropped = self._fold(keep=True)
        phases = {n: {"start_us": round((a[0] - p0) * 1e6), "us": round((a[1] - a[0]) * 1e6),
                      "busy_us": round(a[2] * 1e6), "bytes": a[3], "count": a[4], "n": a[5]} for n, a in acc.items()}
        return {"schema": SCHEMA, "op": self.op, "op_id": self.op_id, "path": self.path, "rank": self.rank,
                "world_size": self.world_size, "global_rank": _global_rank(self.rank), "host": _host(),
                "pid": os.getpid(), "start_unix": round(self.wall0, 6), "duration_us": round(self.duration_s * 1e6),
                "outcome": self.outcome or "running", "phases": phases, "spans": spans, "dropped_spans": dropped,
                "info": dict(self.info)}

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    # ------------------------------------------------------------ logging
    def _event(self, phase: str, event: str, start: float, dur: Optional[float], nbytes: int, count: int) -> dict:
        return {"op": self.op, "op_id": self.op_id, "path": self.path, "rank": self.rank,
                "world_size": self.world_size, "phase": phase, "event": event,
                "start_unix": self.wall0 + start - self.perf0, "duration_s": dur, "bytes": nbytes, "count": count,
                "thread": threading.current_thread().name}

    def _log_phase(self, name: str, event: str, t0: float, t1: Optional[float], nbytes: int, count: int) -> None:
        dur = None if t1 is None else t1 - t0
        if event == "start":
            log.debug("%s rank %d/%d %s: start", self.op, self.rank, self.world_size, name,
                      extra={"bcp": self._event(name, event, t0, None, 0, 0)})
            return
        rate = f" ({nbytes / dur / 1e6:.0f} MB/s)" if nbytes and dur else ""
        log.debug("%s rank %d/%d %s: %.3f s%s%s", self.op, self.rank, self.world_size, name, dur,
                  f", {human_bytes(nbytes)}" if nbytes else "", rate,
                  extra={"bcp": self._event(name, event, t0, dur, nbytes, count)})

    def _log_summary(self, error: Optional[BaseException]) -> None:
        phases = self.phases()
        top = sorted((p for p in phases.values() if p.kind != "detail"), key=lambda p: -p.seconds)[:3]
        parts = ", ".join(f"{p.name} {p.seconds:.2f}" for p in top)
        nbytes = sum(p.bytes for p in phases.values() if p.kind != "detail")
        stall = self.info.get("stall_us")
        event = self._event("", "done" if error is None else "error", self.perf0, self.duration_s, nbytes, 0)
        if error is None:
            log.info("%s %s rank %d/%d: %.2f s (%s)%s%s", self.op, self.path, self.rank, self.world_size,
                     self.duration_s, parts, f", {human_bytes(nbytes)}" if nbytes else "",
                     f", stall {stall / 1e6:.3f} s" if stall is not None else "", extra={"bcp": event})
        else:
            log.info("%s %s rank %d/%d failed after %.2f s: %s", self.op, self.path, self.rank, self.world_size,
                     self.duration_s, type(error).__name__, extra={"bcp": event})


class _Off(Recorder):
    """Recording off (record_stats="off"): a shared, stateless no-op."""

    enabled = False

    def __init__(self) -> None:
        super().__init__("off")

    def span(self, name: str, nbytes: int = 0, count: int = 0) -> _NoSpan:  # type: ignore[override]
        return _NOSPAN

    def add(self, name: str, t0: float, t1: float, nbytes: int = 0, count: int = 0) -> None:
        pass

    def set(self, **info: Any) -> None:
        pass

    def on_finish(self, fn: Callable[["Recorder"], None]) -> None:
        pass

    def finish(self, error: Optional[BaseException] = None) -> None:
        pass

    @property
    def done(self) -> bool:
        return False

    def phases(self) -> Dict[str, Phase]:
        return {}


OFF: Recorder = _Off()


def recorder(enabled: bool, op: str, *, rank: int, world_size: int, path: str, t0: Optional[float] = None,
             sink: Optional["AsideWrites"] = None) -> Recorder:
    return Recorder(op, rank=rank, world_size=world_size, path=path, t0=t0, sink=sink) if enabled else OFF


# ---------------------------------------------------------------------- records beside the checkpoint

def record_key(data_dir: str, op: str, rank: int) -> str:
    """Where rank `rank`'s record of a save (or of the last load) of a checkpoint is kept."""
    return f"{data_dir}/stats/{op}/rank_{rank}.json"


class AsideWrites:
    """Record writes still in flight (an object store's PUT answers later): settled, errors
    swallowed (DEBUG), by wait()/close() and when more than `limit` wait (the oldest first).
    Local files are written before put_aside returns: nothing waits here for them."""

    def __init__(self, limit: int = 64) -> None:
        self._lock = threading.Lock()
        self._pending: Deque[Any] = deque()
        self.limit = limit

    def add(self, request: Any) -> None:
        with self._lock:
            self._pending.append(request)
            old = self._pending.popleft() if len(self._pending) > self.limit else None
        if old is not None:
            _settle(old)

    def settle(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, deque()
        for request in pending:
            _settle(request)


def _settle(request: Any) -> None:
    try:
        request.result()
    except Exception as exc:  # noqa: BLE001 - a record never fails anything
        log.debug("bytecheckpoint: a stats record was not written: %s", exc)


def write_record(rec: Recorder, store: Any, key: str, error: Optional[BaseException] = None) -> None:
    """Finish `rec` and put it beside the checkpoint at `key` (Storage.put_aside: atomic for
    readers, never fsynced, not waited for on object stores: the recorder's AsideWrites settles
    it). Runs where the operation ends (an async save's job thread, else the caller): the record
    exists once the operation returned, even if the process dies right after. Never raises;
    skipped for read-only stores. Its cost is rec.self_s (benchmarks/bench_monitoring.py)."""
    if not rec.enabled:
        return
    rec.finish(error)
    if store is None or getattr(store, "read_only", False):
        return
    t = time.perf_counter()
    try:
        request = store.put_aside(key, rec.dumps())
        if rec.sink is not None:
            rec.sink.add(request)
        else:
            _settle(request)
    except Exception as exc:  # noqa: BLE001 - a record never fails a save or load
        log.debug("bytecheckpoint: the stats record %s was not written: %s", key, exc)
    rec.self_s = time.perf_counter() - t


def parse_record(raw: bytes) -> Dict[str, Any]:
    """A record's JSON, checked: ValueError naming what is wrong (damaged, or a newer schema)."""
    try:
        rec = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(rec, dict):
        raise ValueError("not a JSON object")
    schema = rec.get("schema")
    if schema != SCHEMA:
        if isinstance(schema, str) and schema.startswith("bytecheckpoint.stats/"):
            raise ValueError(f"schema {schema!r} is newer than this bytecheckpoint reads ({SCHEMA}); upgrade it")
        raise ValueError(f"schema {schema!r} is not {SCHEMA!r}")
    want = {"op": str, "op_id": str, "rank": int, "world_size": int, "start_unix": (int, float),
            "duration_us": int, "phases": dict, "spans": list}
    for name, typ in want.items():
        if not isinstance(rec.get(name), typ) or isinstance(rec.get(name), bool):
            raise ValueError(f"field {name!r} is missing or not a {getattr(typ, '__name__', 'number')}")
    for name, p in rec["phases"].items():
        if not isinstance(p, dict) or not all(isinstance(p.get(k), int) for k in ("start_us", "us", "bytes")):
            raise ValueError(f"phase {name!r} is malformed")
    for s in rec["spans"]:
        if not (isinstance(s, list) and len(s) == 6 and isinstance(s[0], str) and isinstance(s[1], int)
                and isinstance(s[2], int)):
            raise ValueError("a span is malformed")
    rec.setdefault("info", {})
    rec.setdefault("host", "?")
    return rec


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


_HOST: List[str] = []


def _host() -> str:
    if not _HOST:
        _HOST.append(socket.gethostname())
    return _HOST[0]


def _global_rank(rank: int) -> int:
    """This process's rank in the default group (LOCAL saves and loads are rank 0 of their own)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # noqa: BLE001 - informational only
        pass
    try:
        return int(os.environ.get("RANK", rank))
    except ValueError:
        return rank
