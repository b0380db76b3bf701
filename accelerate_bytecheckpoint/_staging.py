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

from typing import Any, Callable, Dict, Optional, Tuple

from bytecheckpoint.adapters import staging

from . import _compat as compat
from . import _routes as routes


class WarmUpMixin(staging.WarmUpMixin):
    """ByteCheckpointAttachment's automatic warm-up (it holds _accelerator, _ckpt, _async, active,
    _collective, _writes and _local_state); arming, the trigger and ``warm_up_started``: core's
    adapters/staging.py."""

    def _warm_up_optimizers(self) -> Optional[list]:
        return compat.optimizers(self._accelerator)

    def _warm_up_plan(self) -> Optional[Tuple[bool, Callable[[], Dict[str, Any]]]]:
        route = routes.route_for(self._accelerator, compat.models(self._accelerator))
        collective = self._collective(route)
        if not collective and not self._writes():
            return None
        return collective, self._local_state
