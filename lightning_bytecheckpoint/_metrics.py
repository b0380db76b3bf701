"""``checkpoint/...`` metrics of the plugin's saves and loads, into the Trainer's loggers
(TensorBoard, CSV, W&B, ...): what ``LightningModule.log`` cannot do here (Lightning forbids it in
checkpoint hooks, and a CheckpointIO is no hook). The numbers and their names are core's
(``bytecheckpoint.monitor``); this only finds the loggers and hands the metrics over, on the
training thread (loggers are not thread-safe). Off: ``ByteCheckpointIO(log_metrics=False)`` or
``BCP_LOG_METRICS=0``.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

from bytecheckpoint.common.options import env_flag
from bytecheckpoint.monitor import MetricsFeed

log = logging.getLogger(__name__)


class MetricsLog:
    def __init__(self, enabled: Optional[bool]) -> None:
        self.enabled = env_flag("BCP_LOG_METRICS", True) if enabled is None else bool(enabled)
        self.feed = MetricsFeed()

    def saved(self, io: Any, handle: Any, step: Optional[int]) -> None:
        """After a save: completions of earlier async saves, then this save's numbers (an async
        save's stall now, the rest once it completed)."""
        if self.enabled:
            self.flush(io)
            self._log(io, self.feed.saved(handle, step), step)

    def loaded(self, io: Any, stats: Any, checkpoint: Any) -> None:
        if self.enabled:
            step = checkpoint.get("global_step") if isinstance(checkpoint, dict) else None
            self._log(io, self.feed.loaded(stats), step if isinstance(step, int) else None)

    def flush(self, io: Any) -> None:
        """Completed async saves, logged at the current step (with checkpoint/saved_step)."""
        if self.enabled:
            for metrics in self.feed.ready():
                trainer = _trainer(io)
                self._log(io, metrics, getattr(trainer, "global_step", None))

    def _log(self, io: Any, metrics: Dict[str, float], step: Optional[int]) -> None:
        if not metrics:
            return
        loggers = _loggers(_trainer(io))
        try:
            for logger in loggers:
                logger.log_metrics(metrics, step=step)
                logger.save()
        except Exception as exc:  # noqa: BLE001 - metrics never fail a checkpoint
            log.warning("bytecheckpoint: logging checkpoint metrics to %s failed (%s); turned off for this plugin",
                        type(logger).__name__, exc)
            self.enabled = False


def _trainer(io: Any) -> Any:
    """The Trainer the plugin's strategy serves (None under Fabric, or with no strategy)."""
    module = getattr(io.strategy, "lightning_module", None) if io.strategy is not None else None
    if module is None:
        return None
    try:
        return module.trainer
    except RuntimeError:  # not attached to a Trainer
        return None


def _loggers(trainer: Any) -> List[Any]:
    try:
        return list(getattr(trainer, "loggers", None) or [])
    except Exception:  # noqa: BLE001 - Fabric's trainer shim has none
        return []
