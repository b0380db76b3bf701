"""``checkpoint/...`` metrics of the attachment's saves and loads, through ``accelerator.log``
(every tracker of ``init_trackers``: TensorBoard, W&B, ...; main process only, a no-op without
trackers), at the user's own log steps.

Accelerate keeps no training step and logs only when the script calls ``accelerator.log(values,
step=...)``. So a save's or load's numbers wait (core's ``MetricsHandover``) for the script's next
``accelerator.log`` and go to the trackers in that same call, at its step (an async save's
completion with the first call after it completed, with ``checkpoint/saved_step``). Several saves
waiting for one call are summed into one entry (``checkpoint/saves`` counts them). What no call
took goes at ``end_training()`` (before the trackers finish) or ``remove()``, at ``metrics_step()``
if given, else the step of the script's last ``accelerator.log``. ``checkpoint/saved_step`` is
``metrics_step()`` at the save if given, else ``accelerator.save_iteration`` (the checkpoint count).
Off: ``attach(..., log_metrics=False)`` or ``BCP_LOG_METRICS=0``.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from bytecheckpoint.monitor.metrics import MetricsHandover

log = logging.getLogger(__name__)


class MetricsLog(MetricsHandover):
    def __init__(self, accelerator: Any, enabled: Optional[bool], metrics_step: Optional[Callable[[], int]]) -> None:
        if metrics_step is not None and not callable(metrics_step):
            raise TypeError(f"attach: metrics_step must be a callable returning the training step (e.g. lambda: "
                            f"completed_steps), got {metrics_step!r}")
        super().__init__(enabled)
        self._accelerator, self._step_fn = accelerator, metrics_step
        self._last_step: Optional[int] = None   # the step of the script's last accelerator.log

    def step(self, default: Optional[int]) -> Optional[int]:
        if self._step_fn is None:
            return default
        try:
            return int(self._step_fn())
        except Exception as exc:  # noqa: BLE001 - a bad step callable must not fail a save
            log.warning("bytecheckpoint: metrics_step() failed (%s); metrics logged without a step", exc)
            return None

    def saved(self, handle: Any, step: Optional[int] = None) -> None:
        if self.enabled:
            super().saved(handle, self.step(int(self._accelerator.save_iteration)))

    def log(self, original: Callable[..., Any], values: Any, step: Optional[int] = None, *args: Any, **kwargs: Any) -> Any:
        """The script's ``accelerator.log``: its values with what waits, at its step."""
        if step is not None:
            self._last_step = step
        if isinstance(values, dict):
            values = self.merged(values)
        return original(values, step, *args, **kwargs)

    def end(self) -> None:
        """Training ends (``end_training``, ``remove``; the checkpointer's saves waited for): what no
        ``accelerator.log`` took goes to the trackers now."""
        leftover = self.take()
        acc = self._accelerator
        self.deliver(lambda m: acc.log(m, step=self.step(self._last_step)), leftover, "accelerator.log")


class MetricsMixin:
    """``accelerator.log`` as the attachment wraps it (_attach.py's ``_WRAPPED_METHODS``)."""

    _metrics: MetricsLog

    def _wrapped_log(self, original: Callable[..., Any], values: Any, step: Optional[int] = None,
                     *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_active", False):
            return original(values, step, *args, **kwargs)
        return self._metrics.log(original, values, step, *args, **kwargs)
