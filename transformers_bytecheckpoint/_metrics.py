"""``checkpoint/...`` metrics of the attachment's saves and loads, to the Trainer's callbacks: every
``report_to`` integration (TensorBoard, W&B, MLflow, ...) and the console (the progress bar's or
the printer's line), at the Trainer's own log steps, kept out of ``state.log_history``.

A save's or load's numbers wait (core's ``MetricsHandover``) until the Trainer next logs (every
``logging_steps``, an evaluation, the end of training): the adapter's callback sees that log in
``on_log`` and hands what waits to the same callbacks right after it, by
``callback_handler.on_log``, at the same ``state.global_step``. ``Trainer.log`` is not called, so
``log_history`` (saved in trainer_state.json, compared by resume checks) holds only the Trainer's
own entries; ``attach(..., metrics_in_log_history=True)`` sends them through ``Trainer.log``
instead (``log_history`` then has one more entry per hand-over). An async save's completion goes
with the first log after it completed (the end of ``train()`` waits for every save before the
Trainer's final log), with ``checkpoint/saved_step``; several saves waiting for one log are summed
into one entry (``checkpoint/saves`` counts them); a resume's load numbers go with the first log
of the resumed run. ``control.should_log`` is kept as it was. Off: ``attach(...,
log_metrics=False)`` or ``BCP_LOG_METRICS=0``.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from bytecheckpoint.monitor.metrics import MetricsHandover


class MetricsLog(MetricsHandover):
    def __init__(self, trainer: Any, enabled: Optional[bool], in_history: bool = False) -> None:
        super().__init__(enabled)
        self._trainer, self.in_history = trainer, bool(in_history)
        self._callback: Any = None
        self._sending = False

    def install(self) -> None:
        if self.enabled:
            self._callback = _callback(self)
            self._trainer.add_callback(self._callback)

    def uninstall(self) -> None:
        if self._callback is not None:
            self._trainer.remove_callback(self._callback)
            self._callback = None

    def saved(self, handle: Any, step: Optional[int] = None) -> None:
        super().saved(handle, int(self._trainer.state.global_step))

    def logged(self) -> None:
        """The Trainer logged (its on_log): what waits goes to the same callbacks, at the same step."""
        if not self._sending:
            self._send(self.take())

    def end(self) -> None:
        """``remove()``, the saves waited for: what no Trainer log took (saves made outside ``train()``)."""
        self._send(self.take())

    def _send(self, metrics: Dict[str, float]) -> None:
        tr = self._trainer
        due = bool(tr.control.should_log)   # on_log clears it; a step's pending log must stay pending

        def send(m: Dict[str, float]) -> None:
            self._sending = True
            try:
                if self.in_history:
                    tr.log(dict(m))
                else:
                    tr.control = tr.callback_handler.on_log(tr.args, tr.state, tr.control, dict(m))
            finally:
                self._sending = False
                tr.control.should_log = due

        self.deliver(send, metrics, "the Trainer's callbacks")


def _callback(owner: MetricsLog) -> Any:
    from transformers import TrainerCallback

    class BytecheckpointMetrics(TrainerCallback):
        """Hands the checkpoint/... metrics over after each of the Trainer's logs."""

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001 - TrainerCallback's signature
            owner.logged()

    return BytecheckpointMetrics()
