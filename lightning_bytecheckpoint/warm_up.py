"""The automatic staging warm-up: once every optimizer of the strategy has stepped (the state
exists in full: Adam's moments are made by the first step), the plugin's engine plans the
checkpoint's tensors and allocates its staging slots on a background thread, on the ranks that
will save, the way they will save. The first async save then stalls only for its copy
(docs/async_staging.md has the numbers).

Armed by strategies.py when a strategy takes the plugin; fires from a global optimizer step
post-hook (gate.AfterFirstSteps) inside that first step, on the training thread for the plan (a
walk; a collective only where the save is one), and never raises into training.
Strategies: single device and DDP (global rank 0, alone, as Lightning saves), the sharded adapters
that save parts (every rank, together). Not warmed: FSDP's "full" state (a gather on the training
thread is what warming up would cost) and DeepSpeed (its engine is saved, nothing deferred).
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Optional

import bytecheckpoint as bcp
from bytecheckpoint.adapters import staging
from lightning.pytorch.strategies import DeepSpeedStrategy

from . import _class_switch, _state
from .checkpoint_io import ByteCheckpointIO

log = logging.getLogger(__name__)


def started(io: ByteCheckpointIO) -> Any:
    """The Future of `io`'s last automatic warm-up (bytes allocated), or None if none started."""
    return staging.started(io)


def arm(io: ByteCheckpointIO, strategy: Any) -> None:
    """Warm `io`'s engine up after `strategy`'s optimizers first stepped (once per assignment; the
    trigger and its re-arming: core's adapters/staging.py)."""
    strategy_ref = weakref.ref(strategy)

    def optimizers(io: ByteCheckpointIO) -> Optional[list]:
        s = strategy_ref()
        return list(getattr(s, "optimizers", None) or ()) if s is not None else None

    def fire(io: ByteCheckpointIO) -> Any:
        s = strategy_ref()
        return warm_up(io, s) if s is not None else None
    staging.arm(io, optimizers, fire)  # a re-armed plugin still reports its last warm-up until the new one starts


def warm_up(io: ByteCheckpointIO, strategy: Any) -> Any:
    """Start `io`'s engine's background warm-up for what `strategy` will save; its Future, or None."""
    ckpt = io.checkpointer
    if not (ckpt.options.async_save if io.async_save is None else io.async_save) or ckpt.closed:
        return None
    if isinstance(strategy, DeepSpeedStrategy):
        return None
    parts = _class_switch.is_adapted(strategy) and strategy._saves_parts()
    if _class_switch.is_adapted(strategy) and not parts:
        return None  # FSDP "full": rank 0 saves a gathered state
    if not parts and not strategy.is_global_zero:
        return None  # Lightning saves on global rank 0 alone
    optimizer_states = [strategy.optimizer_state(o) for o in strategy.optimizers]
    if parts:
        optimizer_states = [_state.names_to_positions(s) if _state.keyed_by_names(s) else s for s in optimizer_states]
    state = {"state_dict": strategy.lightning_module_state_dict(), "optimizer_states": optimizer_states}
    log.debug("bytecheckpoint: staging warm-up starting after the first optimizer step")
    return ckpt.warm_up(state, process_group=None if parts else bcp.LOCAL, background=True)
