"""``checkpoint/...`` metrics of the attachment's saves and loads, through ``accelerator.log``
(every tracker of ``init_trackers``: TensorBoard, W&B, ...; main process only, a no-op without
trackers). The numbers and their names are core's (``bytecheckpoint.monitor``); handed over on
the training thread only (trackers are not known to be thread-safe).

Step: Accelerate keeps no training step, so metrics go at ``metrics_step()`` when given (e.g.
``lambda: completed_steps``), else at ``accelerator.save_iteration`` (the checkpoint count). An
async save's completion is logged at the step current then, with ``checkpoint/saved_step``.
Off: ``attach(..., log_metrics=False)`` or ``BCP_LOG_METRICS=0``.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional

from bytecheckpoint.common.options import env_flag
from bytecheckpoint.monitor import MetricsFeed

log = logging.getLogger(__name__)


class MetricsLog:
    def __init__(self, accelerator: Any, enabled: Optional[bool], metrics_step: Optional[Callable[[], int]]) -> None:
        if metrics_step is not None and not callable(metrics_step):
            raise TypeError(f"attach: metrics_step must be a callable returning the training step (e.g. lambda: "
                            f"completed_steps), got {metrics_step!r}")
        self.enabled = env_flag("BCP_LOG_METRICS", True) if enabled is None else bool(enabled)
        self._accelerator, self._step_fn = accelerator, metrics_step
        self.feed = MetricsFeed()

    def step(self) -> Optional[int]:
        try:
            return int(self._step_fn()) if self._step_fn is not None else int(self._accelerator.save_iteration)
        except Exception as exc:  # noqa: BLE001 - a bad step callable must not fail a save
            log.warning("bytecheckpoint: metrics_step() failed (%s); metrics logged without a step", exc)
            return None

    def saved(self, handle: Any) -> None:
        if self.enabled:
            self.flush()
            step = self.step()
            self._log(self.feed.saved(handle, step), step)

    def loaded(self, stats: Any) -> None:
        if self.enabled:
            self._log(self.feed.loaded(stats), self.step())

    def flush(self) -> None:
        """Completed async saves, at the current step (with checkpoint/saved_step)."""
        if self.enabled:
            ready = self.feed.ready()
            if ready:
                step = self.step()
                for metrics in ready:
                    self._log(metrics, step)

    def _log(self, metrics: Dict[str, float], step: Optional[int]) -> None:
        if not metrics:
            return
        try:
            self._accelerator.log(metrics, step=step)
        except Exception as exc:  # noqa: BLE001 - metrics never fail a checkpoint
            log.warning("bytecheckpoint: accelerator.log of checkpoint metrics failed (%s); turned off", exc)
            self.enabled = False
