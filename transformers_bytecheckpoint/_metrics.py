"""``checkpoint/...`` metrics of the attachment's saves and loads, through ``Trainer.log`` (its
``log_history`` and every ``report_to`` integration). The numbers and their names are core's
(``bytecheckpoint.monitor``); handed over on the training thread only.

Where ``Trainer.log`` is safe: it ends with ``on_log``, which clears ``control.should_log``, so it
is never called from a step-end hook (the Trainer's own loss log of that step would be dropped);
a JIT checkpoint (SIGTERM) is saved from step hooks by transformers itself, so a pending
``should_log`` is set again after our log. Save metrics are logged right after the stock ``_save_checkpoint`` (the step's log has been
written by then); a resume's load metrics from ``on_train_begin`` (the resumed ``log_history`` is
in place by then); completions of async saves at the next save, the end of training, ``wait()``,
at the step current then, with ``checkpoint/saved_step``. Off: ``attach(..., log_metrics=False)``
or ``BCP_LOG_METRICS=0``.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional

from bytecheckpoint.common.options import env_flag
from bytecheckpoint.monitor import MetricsFeed

log = logging.getLogger(__name__)


class MetricsLog:
    def __init__(self, trainer: Any, enabled: Optional[bool]) -> None:
        self.enabled = env_flag("BCP_LOG_METRICS", True) if enabled is None else bool(enabled)
        self._trainer = trainer
        self.feed = MetricsFeed()
        self._load: Optional[Dict[str, float]] = None   # a resume's metrics, until on_train_begin
        self._callback: Any = None

    def install(self) -> None:
        if self.enabled:
            self._callback = _callback(self)
            self._trainer.add_callback(self._callback)

    def uninstall(self) -> None:
        if self._callback is not None:
            self._trainer.remove_callback(self._callback)
            self._callback = None

    def saved(self, handle: Any) -> None:
        if self.enabled:
            self.flush()
            self._log(self.feed.saved(handle, int(self._trainer.state.global_step)))

    def loaded(self, stats: Any) -> None:
        if self.enabled:
            self._load = self.feed.loaded(stats) or None

    def flush(self) -> None:
        if self.enabled:
            for metrics in self.feed.ready():
                self._log(metrics)

    def train_begins(self) -> None:
        load, self._load = self._load, None
        if load:
            self._log(load)

    def _log(self, metrics: Dict[str, float]) -> None:
        if not metrics:
            return
        # A JIT checkpoint (SIGTERM) may save from a step-end hook, after DefaultFlowCallback asked
        # for this step's log: Trainer.log's on_log clears control.should_log, so ask again.
        due = bool(getattr(getattr(self._trainer, "control", None), "should_log", False))
        try:
            self._trainer.log(dict(metrics))
            if due:
                self._trainer.control.should_log = True
        except Exception as exc:  # noqa: BLE001 - metrics never fail a checkpoint
            log.warning("bytecheckpoint: Trainer.log of checkpoint metrics failed (%s); turned off", exc)
            self.enabled = False


def _callback(owner: MetricsLog) -> Any:
    from transformers import TrainerCallback

    class BytecheckpointMetrics(TrainerCallback):
        """Logs a resume's checkpoint/load_* metrics once training begins."""

        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001 - TrainerCallback's signature
            owner.train_begins()

    return BytecheckpointMetrics()
