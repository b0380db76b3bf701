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
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from .record import OFF, Phase, Recorder

PREFIX = "checkpoint/"
MAX_PENDING = 16


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


class MetricsFeed:
    """`checkpoint/...` metrics for a framework logger, handed out on the caller's (training)
    thread only: loggers are not thread-safe. A sync save's metrics come at once; an async save's
    stall at once and the rest from `ready()` once it completed (failed saves give nothing more:
    their error surfaces through the handle)."""

    def __init__(self) -> None:
        self._pending: List[Tuple[SaveStats, Optional[int]]] = []

    def __getstate__(self) -> Dict[str, Any]:  # a pickled adapter (ddp_spawn): saves in flight stay here
        return {"_pending": []}

    def saved(self, handle: Any, step: Optional[int] = None) -> Dict[str, float]:
        stats = getattr(handle, "stats", None)
        if not isinstance(stats, SaveStats):
            return {}
        if stats.done or not getattr(handle, "is_async", False):
            return stats.metrics()
        if stats.recording:
            self._pending.append((stats, step))
            del self._pending[:-MAX_PENDING]
        return {k: v for k, v in stats.metrics().items() if k.endswith("save_stall_s")}

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
                m = {k: v for k, v in stats.metrics().items() if not k.endswith("save_stall_s")}
                if step is not None:
                    m[PREFIX + "saved_step"] = float(step)
                out.append(m)
        self._pending = keep
        return out
