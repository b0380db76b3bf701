"""The adapters' automatic staging warm-up and per-call async staging (docs/async_staging.md).

Once every optimizer of the training has stepped (the state exists in full: Adam's moments are made
by the first step), the adapter's checkpointer plans the state its next save will write and
allocates the staging slots on a background thread, on the processes that will write, the way they
will write (collectively for sharded state). The first async save then stalls only for its copy.
The trigger is a global optimizer step post-hook (``pipeline.gate.AfterFirstSteps``): it fires inside
that first step on every process (they step together), and a GradScaler-skipped step does not count.

* ``arm(owner, optimizers, fire)`` / ``started(owner)``: one trigger per owner (an attachment, a
  Lightning plugin), re-armable; ``started`` is the warm-up's Future (bytes allocated) or None.
* ``WarmUpMixin``: an attachment's warm-up (``_arm_warm_up``, ``warm_up_started``); the adapter says
  which optimizers count and what is saved how (``_warm_up_optimizers``, ``_warm_up_plan``).
* ``per_call(async_staging, owns)``: the ``async_staging=`` keyword a shared checkpointer gets per call.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from ..collectives.comm import LOCAL
from ..pipeline.gate import AfterFirstSteps

logger = logging.getLogger(__name__)
_TRIGGERS: "weakref.WeakKeyDictionary[Any, AfterFirstSteps]" = weakref.WeakKeyDictionary()


def arm(owner: Any, optimizers: Callable[[Any], Optional[Sequence[Any]]],
        fire: Callable[[Any], Any]) -> AfterFirstSteps:
    """Call ``fire(owner)`` once every optimizer of ``optimizers(owner)`` (read at every step; None:
    disarm) has stepped once. Arming again replaces the owner's trigger; ``started`` keeps reporting
    the last warm-up until the new one starts."""
    old = _TRIGGERS.pop(owner, None)
    if old is not None:
        old.remove()
    trigger = AfterFirstSteps(optimizers, fire, owner=owner, result=old.result if old is not None else None)
    _TRIGGERS[owner] = trigger
    return trigger


def started(owner: Any) -> Any:
    """The Future (bytes allocated) of ``owner``'s last automatic warm-up, or None if none started."""
    trigger = _TRIGGERS.get(owner)
    return trigger.result if trigger is not None else None


def per_call(async_staging: Optional[bool], owns: bool) -> Dict[str, Any]:
    """A shared checkpointer gets ``async_staging`` per call (an owned one was built with it)."""
    return {"async_staging": bool(async_staging)} if async_staging is not None and not owns else {}


class WarmUpMixin:
    """An attachment's automatic warm-up (it holds _ckpt, _async and active). The adapter implements
    ``_warm_up_optimizers()`` (the optimizers whose first steps fire it) and ``_warm_up_plan()``:
    None where this process writes nothing, else (collective, a function building the state)."""

    def _arm_warm_up(self) -> None:
        arm(self, _optimizers, _fire)

    @property
    def warm_up_started(self) -> Any:
        """The Future (bytes allocated) of the automatic warm-up, or None before it started."""
        return started(self)

    def _warm_up_optimizers(self) -> Optional[list]:
        raise NotImplementedError

    def _warm_up_plan(self) -> Optional[Tuple[bool, Callable[[], Dict[str, Any]]]]:
        raise NotImplementedError

    def _warm_up_now(self) -> Any:
        if not self._async or self._ckpt.closed:
            return None
        plan = self._warm_up_plan()
        if plan is None:
            return None
        collective, state = plan
        group = {} if collective else {"process_group": LOCAL}
        logger.debug("bytecheckpoint: staging warm-up starting after the first optimizer step")
        return self._ckpt.warm_up(state(), background=True, **group)


def _optimizers(a: WarmUpMixin) -> Optional[list]:
    return a._warm_up_optimizers() if a.active else None  # None: removed, disarm


def _fire(a: WarmUpMixin) -> Any:
    return a._warm_up_now()
