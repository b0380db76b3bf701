"""``checkpoint/...`` metrics of the plugin's saves and loads, into the Trainer's loggers
(TensorBoard, CSV, W&B, ...), at the Trainer's logging cadence: what ``LightningModule.log`` cannot
do here (Lightning forbids it in checkpoint hooks, and a CheckpointIO is no hook).

A save's or load's numbers wait (core's ``MetricsHandover``) until Lightning's logger connector
next logs at the training step (every ``log_every_n_steps``, an epoch end, ``should_stop``) and go
to the loggers in that same call, at Lightning's step, with its single ``logger.save()``;
``trainer.logged_metrics`` then holds them too. An async save's completion goes with the first
log step after it completed. Several saves waiting for one log step are summed into one entry
(``checkpoint/saves`` counts them). What no log step took by the end of the run goes to the
loggers at the plugin's teardown (the checkpointer's saves waited for first), at Lightning's
last step, before Lightning finalizes them (a run stopped by an exception logs nothing more).
Off: ``ByteCheckpointIO(log_metrics=False)`` or ``BCP_LOG_METRICS=0``.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Dict, List, Optional

from bytecheckpoint.monitor.metrics import MetricsHandover

from . import _compat

log = logging.getLogger(__name__)


class MetricsLog(MetricsHandover):
    def __init__(self, enabled: Optional[bool]) -> None:
        super().__init__(enabled)
        self._connected: Optional[weakref.ref] = None   # the Trainer whose log calls carry them

    def __getstate__(self) -> Dict[str, Any]:  # ddp_spawn pickles the plugin: the new process connects anew
        return {**self.__dict__, "_connected": None}

    def saved(self, io: Any, handle: Any, step: Optional[int]) -> None:  # type: ignore[override]
        if self._connect(io):
            super().saved(handle, step)

    def loaded(self, io: Any, stats: Any, checkpoint: Any) -> None:  # type: ignore[override]
        if self._connect(io):
            super().loaded(stats)

    def _connect(self, io: Any) -> bool:
        """A Trainer with loggers runs this plugin: its log steps carry what waits from now on."""
        if not self.enabled:
            return False
        trainer = _trainer(io)
        if trainer is None or not _loggers(trainer):
            return False
        try:
            _compat.merge_into_logs(trainer, self, self.merged)
        except _compat.LightningCompatError as exc:  # metrics never fail a checkpoint
            log.warning("bytecheckpoint: checkpoint metrics turned off: %s", exc)
            self.enabled = False
            return False
        self._connected = weakref.ref(trainer)
        return True

    def flush(self, io: Any) -> None:
        """The run ends (the plugin's teardown, the checkpointer's saves waited for): what no log
        step took goes to the loggers now, at Lightning's step; the connector is restored."""
        trainer = self._connected() if self._connected is not None else None
        self._connected = None
        if trainer is None:
            return
        _compat.unmerge(trainer, self)
        leftover = self.take()
        if leftover and not trainer.interrupted:  # an exception finalized the loggers already
            loggers = _loggers(trainer)

            def send(metrics: Dict[str, float]) -> None:
                step = _compat.log_step(trainer)
                for logger in loggers:
                    logger.log_metrics(metrics, step=step)

            self.deliver(send, leftover, ", ".join(type(lg).__name__ for lg in loggers))


def _trainer(io: Any) -> Any:
    """The Trainer the plugin's strategy serves (None under Fabric, or with no strategy)."""
    from lightning.pytorch import Trainer

    module = getattr(io.strategy, "lightning_module", None) if io.strategy is not None else None
    if module is None:
        return None
    try:
        trainer = module.trainer
    except RuntimeError:  # not attached to a Trainer
        return None
    return trainer if isinstance(trainer, Trainer) else None  # Fabric's shim: no Trainer, no log steps


def _loggers(trainer: Any) -> List[Any]:
    try:
        return list(getattr(trainer, "loggers", None) or [])
    except Exception:  # noqa: BLE001 - Fabric's trainer shim has none
        return []
