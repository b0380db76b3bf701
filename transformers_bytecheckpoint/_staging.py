"""Async staging for attach(trainer): the per-call `async_staging` setting and the automatic staging
warm-up. Once the Trainer's optimizer has stepped (the state exists in full: Adam's moments are made
by the first step), the attachment's checkpointer plans the state a checkpoint will write and
allocates its staging slots on a background thread, on the processes that write, the way they write
(collectively for sharded state). The first async checkpoint then stalls only for its copy
(docs/async_staging.md).

The trigger is a global optimizer step post-hook (gate.AfterFirstSteps) rather than a TrainerCallback:
it fires inside the step on every process (they step together), after the update that creates the
state, and a GradScaler-skipped step does not count. Under DeepSpeed the torch optimizer the Trainer
holds never steps itself (the engine does): no warm-up there, and nothing is deferred either.
"""
from __future__ import annotations

import logging
import types
import weakref
from typing import Any, Dict, Optional

import bytecheckpoint as bcp
from bytecheckpoint.pipeline.gate import AfterFirstSteps

from . import _routes as routes

logger = logging.getLogger(__name__)
_TRIGGERS: "weakref.WeakKeyDictionary[Any, AfterFirstSteps]" = weakref.WeakKeyDictionary()
# what _state saves of a checkpoint's tensors (no RNG: its gather is a collective of its own)
_TENSORS = types.SimpleNamespace(output_dir=None, optimizer=True, scaler=True, rng=False, push=None)


class WarmUpMixin:
    """TrainerAttachment's async staging (it holds _trainer, _ckpt, _async, active and _state)."""

    _staging_kw: Dict[str, Any] = {}

    def _staging_setup(self, async_staging: Optional[bool], owns: bool) -> None:
        """A shared checkpointer gets `async_staging` per call (an owned one was built with it)."""
        self._staging_kw = {"async_staging": bool(async_staging)} if async_staging is not None and not owns else {}
        _TRIGGERS[self] = AfterFirstSteps(_optimizers, lambda a: a._warm_up_now(), owner=self)

    @property
    def warm_up_started(self) -> Any:
        """The Future (bytes allocated) of the automatic warm-up, or None before it started."""
        trigger = _TRIGGERS.get(self)
        return trigger.result if trigger is not None else None

    def _warm_up_now(self) -> Any:
        if not self._async or self._ckpt.closed:
            return None
        tr = self._trainer
        route = routes.route_for(tr)
        if not (route.collective or tr.args.should_save):
            return None
        group = {} if route.collective else {"process_group": bcp.LOCAL}
        logger.debug("bytecheckpoint: staging warm-up starting after the first optimizer step")
        return self._ckpt.warm_up(self._state(route, _TENSORS), background=True, **group)


def _optimizers(a: WarmUpMixin) -> Optional[list]:
    if not a.active:
        return None  # removed: disarm
    return [a._trainer.optimizer] if a._trainer.optimizer is not None else []
