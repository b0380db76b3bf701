"""This rank's numbers of a save or load as `checkpoint/...` metrics, and the feed the framework
adapters hand to their loggers (Lightning's loggers, Accelerate's trackers, the Trainer's log).

Metric names (floats, so any tracker takes them):
  checkpoint/save_stall_s   how long save() blocked the caller
  checkpoint/save_s         save() called -> committed, on this rank
  checkpoint/save_write_s   the write phase (encode, checksum, pack files, fsync)
  checkpoint/save_bytes     bytes this rank wrote
  checkpoint/save_mb_s      save_bytes / save_s
  checkpoint/load_s, checkpoint/load_bytes (read + received from peers), checkpoint/load_mb_s
  checkpoint/saved_step     with an async save's completion, logged later: the step it saved
  checkpoint/saves, checkpoint/saves_completed, checkpoint/loads
                            only where several waited for one log step (fold): how many saves'
                            stalls, saves' completions (save_s ...), loads were summed into it

The adapters hold these until the framework logs (MetricsHandover): Lightning's next log step,
the Trainer's next log, the user's next ``accelerator.log``; several waiting for the same log
step are folded into one entry (seconds and bytes summed).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from ..common.options import env_flag
from .record import OFF, Phase, Recorder

PREFIX = "checkpoint/"
MAX_PENDING = 16
_SUMMED = ("save_stall_s", "save_s", "save_write_s", "save_bytes", "load_s", "load_bytes")
_RATES = {"save_mb_s": ("save_bytes", "save_s"), "load_mb_s": ("load_bytes", "load_s")}
_COUNTED = {"saves": "save_stall_s", "saves_completed": "save_s", "loads": "load_s"}   # count: what marks one
log = logging.getLogger(__name__)


class SaveStats(dict):
    """SaveHandle.stats: the inline numbers of today (walk_s, plan_s, stall_s, copy_s, copy_wait_s,
    total_s, copies_started_early, first_copy_s) plus this rank's recorded phases. `total_s` is
    set for async saves too once the save completed on this rank (with recording on)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rec: Recorder = OFF

    def attach(self, rec: Recorder) -> None:
        self._rec = rec
        rec.on_finish(lambda r: self.setdefault("total_s", r.duration_s))

    @property
    def recording(self) -> bool:
        return self._rec.enabled

    @property
    def done(self) -> bool:
        """The save finished on this rank (committed, or failed) and these numbers are final.
        With recording on, total_s comes from the recorder's finish listener, which runs on the
        job thread after the recorder is marked done: wait for both."""
        return ("total_s" in self and self._rec.done) if self._rec.enabled else "total_s" in self

    @property
    def ok(self) -> bool:
        return self._rec.outcome == "ok" if self._rec.enabled else "total_s" in self

    @property
    def phases(self) -> Dict[str, Phase]:
        """This rank's phases so far (top-level and details), by name."""
        return self._rec.phases()

    @property
    def record(self) -> Optional[Dict[str, Any]]:
        """The record written beside the checkpoint (None before the save finished, or recording off)."""
        return self._rec.to_json() if self._rec.enabled and self._rec.done else None

    def metrics(self, prefix: str = PREFIX) -> Dict[str, float]:
        out: Dict[str, float] = {}
        stall = self.get("stall_s", self.get("total_s"))
        if stall is not None:
            out[prefix + "save_stall_s"] = float(stall)
        if not self.done or not self.ok or "total_s" not in self:
            return out
        total = float(self["total_s"])
        out[prefix + "save_s"] = total
        write = self.phases.get("write")
        if write is not None:
            out[prefix + "save_write_s"] = write.seconds
            out[prefix + "save_bytes"] = float(write.bytes)
            if total > 0:
                out[prefix + "save_mb_s"] = write.bytes / total / 1e6
        return out

    def __repr__(self) -> str:
        return f"SaveStats({dict.__repr__(self)}, phases={sorted(self.phases)})"


def load_metrics(total_s: Optional[float], nbytes: int, prefix: str = PREFIX) -> Dict[str, float]:
    if total_s is None:
        return {}
    out = {prefix + "load_s": float(total_s), prefix + "load_bytes": float(nbytes)}
    if total_s > 0:
        out[prefix + "load_mb_s"] = nbytes / total_s / 1e6
    return out


def _completion(stats: SaveStats, step: Optional[int]) -> Dict[str, float]:
    """An async save's metrics once it completed: all but its stall (given at save time), with
    checkpoint/saved_step when its step is known."""
    m = {k: v for k, v in stats.metrics().items() if not k.endswith("save_stall_s")}
    if step is not None:
        m[PREFIX + "saved_step"] = float(step)
    return m


class MetricsFeed:
    """`checkpoint/...` metrics for a framework logger, handed out on the caller's (training)
    thread only: loggers are not thread-safe. A sync save's metrics come at once; an async save's
    stall at once and the rest from `ready()` once it completed (failed saves give nothing more:
    their error surfaces through the handle)."""

    def __init__(self) -> None:
        self._pending: List[Tuple[SaveStats, Optional[int]]] = []
        self._held: List[Dict[str, float]] = []   # known, waiting for the framework's next log

    def __getstate__(self) -> Dict[str, Any]:  # a pickled adapter (ddp_spawn): saves in flight stay here
        return {"_pending": [], "_held": []}

    def saved(self, handle: Any, step: Optional[int] = None) -> Dict[str, float]:
        stats = getattr(handle, "stats", None)
        if not isinstance(stats, SaveStats):
            return {}
        if not getattr(handle, "is_async", False):
            return stats.metrics()
        stall = {k: v for k, v in stats.metrics().items() if k.endswith("save_stall_s")}
        if stats.done:  # a small async save can complete before this call: its completion goes out now
            return {**stall, **_completion(stats, step)} if stats.ok else stall
        if stats.recording:
            self._pending.append((stats, step))
            del self._pending[:-MAX_PENDING]
        return stall

    @staticmethod
    def loaded(stats: Any) -> Dict[str, float]:
        metrics = getattr(stats, "metrics", None)
        return metrics() if callable(metrics) else {}

    def ready(self) -> List[Dict[str, float]]:
        """Completed async saves not yet handed out, in order (each with checkpoint/saved_step when
        its step was known): log them at the current step."""
        out, keep = [], []
        for stats, step in self._pending:
            if not stats.done:
                keep.append((stats, step))
                continue
            if stats.ok:
                out.append(_completion(stats, step))
        self._pending = keep
        return out

    def hold(self, metrics: Dict[str, float]) -> None:
        """Keep ``metrics`` until ``take()`` (the framework's next log step)."""
        if metrics:
            self._held.append(dict(metrics))
            if len(self._held) > MAX_PENDING:   # a framework that does not log for long: fold as we go
                self._held = [fold(self._held)]

    @property
    def waiting(self) -> bool:
        """Something is held, or an async save's completion is still to come."""
        return bool(self._held or self._pending)

    def take(self) -> Dict[str, float]:
        """Everything known now and not handed out yet (held numbers, completed async saves), as
        one entry for the framework's log step ({} when there is nothing)."""
        entries, self._held = self._held + self.ready(), []
        return fold(entries)


def fold(entries: Iterable[Dict[str, float]], prefix: str = PREFIX) -> Dict[str, float]:
    """Several entries that wait for one log step, as one: seconds and bytes summed, MB/s from the
    sums, ``saved_step`` the newest; ``saves`` (stalls), ``saves_completed`` (save_s, ...) and
    ``loads`` count what was summed where that is more than one (an entry folded before counts with
    its own counts). One entry: unchanged."""
    entries = [e for e in entries if e]
    if len(entries) <= 1:
        return dict(entries[0]) if entries else {}
    out: Dict[str, float] = {}
    counts = dict.fromkeys(_COUNTED, 0.0)
    for e in entries:
        for key, value in e.items():
            name = key[len(prefix):] if key.startswith(prefix) else None
            if name in _SUMMED:
                out[key] = out.get(key, 0.0) + float(value)
            elif name == "saved_step":
                out[key] = max(out.get(key, float(value)), float(value))
            elif name not in _RATES and name not in _COUNTED:
                out[key] = value   # a key of someone else's: the newest value
        for count, marker in _COUNTED.items():
            if prefix + marker in e:
                counts[count] += float(e.get(prefix + count, 1))
    for rate, (nbytes, seconds) in _RATES.items():
        if prefix + nbytes in out and out.get(prefix + seconds, 0.0) > 0:
            out[prefix + rate] = out[prefix + nbytes] / out[prefix + seconds] / 1e6
    out.update({prefix + count: n for count, n in counts.items() if n > 1})
    return out


class MetricsHandover:
    """An adapter's side of the metrics: on or off (``log_metrics=``, else ``BCP_LOG_METRICS``),
    this engine's numbers held in a ``MetricsFeed`` until the framework logs, and the hand-over
    guarded (metrics never fail a checkpoint: a logger that raises turns them off, with a warning).
    The adapters decide when their framework logs and how the entry gets there."""

    def __init__(self, enabled: Optional[bool]) -> None:
        self.enabled = env_flag("BCP_LOG_METRICS", True) if enabled is None else bool(enabled)
        self.feed = MetricsFeed()

    def saved(self, handle: Any, step: Optional[int] = None) -> None:
        """A save returned: its numbers known now (an async save's stall), the rest on completion."""
        if self.enabled:
            self.feed.hold(self.feed.saved(handle, step))

    def loaded(self, stats: Any) -> None:
        if self.enabled:
            self.feed.hold(MetricsFeed.loaded(stats))

    def take(self) -> Dict[str, float]:
        """What the framework's log step now carries ({} when off or nothing waits)."""
        return self.feed.take() if self.enabled else {}

    def merged(self, values: Dict[str, Any]) -> Dict[str, Any]:
        """``values`` (the framework's own entry, not modified) with what waits added."""
        ours = self.take()
        return {**values, **ours} if ours else values

    def deliver(self, send: Callable[[Dict[str, float]], Any], metrics: Dict[str, float], where: str) -> None:
        """Hand ``metrics`` over by ``send`` outside a log call of the framework (the end of a run)."""
        if not metrics or not self.enabled:
            return
        try:
            send(metrics)
        except Exception as exc:  # noqa: BLE001 - metrics never fail a checkpoint
            log.warning("bytecheckpoint: logging checkpoint metrics to %s failed (%s); turned off", where, exc)
            self.enabled = False
