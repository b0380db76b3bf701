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

import functools
import types
from typing import Any, Callable, Dict, Optional, Tuple

from bytecheckpoint.adapters import staging

from . import _routes as routes

# what _state saves of a checkpoint's tensors (no RNG: its gather is a collective of its own)
_TENSORS = types.SimpleNamespace(output_dir=None, optimizer=True, scaler=True, rng=False, push=None)


class WarmUpMixin(staging.WarmUpMixin):
    """TrainerAttachment's async staging (it holds _trainer, _ckpt, _async, active and _state); the
    trigger and ``warm_up_started``: core's adapters/staging.py."""

    _staging_kw: Dict[str, Any] = {}

    def _staging_setup(self, async_staging: Optional[bool], owns: bool) -> None:
        """A shared checkpointer gets `async_staging` per call (an owned one was built with it)."""
        self._staging_kw = staging.per_call(async_staging, owns)
        self._arm_warm_up()

    def _warm_up_optimizers(self) -> Optional[list]:
        return [self._trainer.optimizer] if self._trainer.optimizer is not None else []

    def _warm_up_plan(self) -> Optional[Tuple[bool, Callable[[], Dict[str, Any]]]]:
        tr = self._trainer
        route = routes.route_for(tr)
        if not (route.collective or tr.args.should_save):
            return None
        return route.collective, functools.partial(self._state, route, _TENSORS)
