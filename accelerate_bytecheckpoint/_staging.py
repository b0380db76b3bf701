"""Async staging for attach(): the automatic staging warm-up. Once every prepared optimizer has
stepped (the state exists in full: Adam's moments are made by the first step), the attachment's
checkpointer plans the state save_state will write and allocates its staging slots on a
background thread, on the processes that will write, the way they will write (collectively for
sharded state). The first async save_state then stalls only for its copy (docs/async_staging.md).

Accelerate has no callbacks: the trigger is a global optimizer step post-hook (gate.AfterFirstSteps),
fired inside that first step on every process (they step together: gradients are synchronised), so a
collective plan lines up; a GradScaler-skipped step runs no hook on any process. Async staging
itself needs nothing here: the state holds the torch optimizers, which the engine finds.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Optional

import bytecheckpoint as bcp
from bytecheckpoint.pipeline.gate import AfterFirstSteps

from . import _compat as compat
from . import _routes as routes

logger = logging.getLogger(__name__)
_TRIGGERS: "weakref.WeakKeyDictionary[Any, AfterFirstSteps]" = weakref.WeakKeyDictionary()


class WarmUpMixin:
    """ByteCheckpointAttachment's automatic warm-up (it holds _accelerator, _ckpt, _async, active,
    _collective, _writes and _local_state)."""

    def _arm_warm_up(self) -> None:
        _TRIGGERS[self] = AfterFirstSteps(_optimizers, lambda a: a._warm_up_now(), owner=self)

    @property
    def warm_up_started(self) -> Any:
        """The Future (bytes allocated) of the automatic warm-up, or None before it started."""
        trigger = _TRIGGERS.get(self)
        return trigger.result if trigger is not None else None

    def _warm_up_now(self) -> Any:
        if not self._async or self._ckpt.closed:
            return None
        route = routes.route_for(self._accelerator, compat.models(self._accelerator))
        collective = self._collective(route)
        if not collective and not self._writes():
            return None
        group = {} if collective else {"process_group": bcp.LOCAL}
        logger.debug("bytecheckpoint: staging warm-up starting after the first optimizer step")
        return self._ckpt.warm_up(self._local_state(), background=True, **group)


def _optimizers(a: WarmUpMixin) -> Optional[list]:
    return compat.optimizers(a._accelerator) if a.active else None  # None: removed, disarm
