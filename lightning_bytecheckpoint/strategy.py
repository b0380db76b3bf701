"""Strategy-side adapter that ``ByteCheckpointIO`` installs on the strategy it is attached to.

Why it exists. Lightning's strategies decide *who* calls the ``CheckpointIO``:

* ``Strategy.save_checkpoint`` / ``remove_checkpoint`` call it on global rank 0 only. A
  bytecheckpoint save is collective (every rank writes its balanced share), so every rank has
  to call it.
* ``FSDPStrategy`` (sharded) and ``ModelParallelStrategy`` bypass the ``CheckpointIO`` and
  call torch.distributed.checkpoint directly.

``CheckpointIO`` has no hook that runs on every rank before the first save, and no reference
to its strategy, so the plugin cannot fix either from its own hooks. The one place where a
``CheckpointIO`` meets its strategy on every rank is the ``Strategy.checkpoint_io`` setter
(the Trainer's accelerator connector assigns the plugin there, in every process, before
anything runs). :func:`install_strategy_hook` wraps that setter once; when a
``ByteCheckpointIO`` is assigned, the strategy instance (only that one) is switched to a
subclass that adds the small adapter matching its type (see ``_ADAPTERS``):

* every strategy: ``save_checkpoint`` runs on all ranks with the path broadcast from rank 0
  (ranks may format different names from unsynced metrics); ``teardown`` waits for in-flight
  saves while the process group is still alive. ``remove_checkpoint`` stays rank-0-only:
  deleting is not collective.
* ``ModelParallelStrategy`` (restores after setup, shards parameters as DTensors): it is told
  to produce sharded state dicts, and ``load_checkpoint`` loads model and optimizer in place
  into the current (possibly different) sharding and the rest as full values.

Loading for DDP / single device needs no adapter: ``Strategy.load_checkpoint`` already calls
the plugin on every rank, and the plugin returns full CPU tensors that Lightning restores.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
)
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

if TYPE_CHECKING:
    from .checkpoint_io import ByteCheckpointIO

_ADAPTED = "_bytecheckpoint_base"  # class attribute of adapted classes: the original strategy class


class _CollectiveSave(Strategy):
    """Every rank takes part in each save; teardown waits for in-flight saves.

    A mixin placed before the concrete strategy class. It derives from ``Strategy`` (and is
    never instantiated) so that the combined class keeps the strategy's instance layout, which
    the ``__class__`` switch requires.
    """

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        path = self.broadcast(str(filepath))
        self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)

    @override
    def teardown(self) -> None:
        try:
            self.checkpoint_io.teardown()  # while the process group is still up
        finally:
            super().teardown()

    @override
    def __reduce_ex__(self, protocol: int) -> Any:  # ddp_spawn pickles the trainer
        return _rebuild, (getattr(type(self), _ADAPTED),), self.__getstate__()


class _ShardedInPlaceLoad(_CollectiveSave):
    """For strategies that restore after setup and shard parameters as DTensors (ModelParallel)."""

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = self.broadcast(str(checkpoint_path))
        io: ByteCheckpointIO = self.checkpoint_io
        if not io.is_bytecheckpoint(path):
            return super().load_checkpoint(path, weights_only=weights_only)  # the strategy's own formats
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        # Model and optimizer states are templates in their current (sharded) layout, loaded in
        # place; every other saved key gets a ``None`` placeholder that receives its full value.
        trainer = self.lightning_module._trainer
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        model_strict = self.lightning_module.strict_loading
        saved = io.saved_keys(path)
        strict = model_strict and saved is not None  # the engine's strict compares all saved keys
        state: dict[str, Any] = {key: None for key in saved or ["state_dict", "optimizer_states"]}
        state["state_dict"] = get_model_state_dict(self.model)
        if "optimizer_states" in state:
            if fitting and self.optimizers:
                state["optimizer_states"] = [get_optimizer_state_dict(self.model, opt) for opt in self.optimizers]
            else:  # evaluating: optimizer states are not read (so not every saved key is matched)
                del state["optimizer_states"]
                strict = False
        state = io.read_into(path, state, strict=strict, weights_only=weights_only)
        set_model_state_dict(self.model, state.pop("state_dict"), options=StateDictOptions(strict=model_strict))
        for opt, opt_state in zip(self.optimizers, state.pop("optimizer_states", [])):
            set_optimizer_state_dict(self.model, opt, opt_state)
        return state


def _prefer_sharded_model_parallel(strategy: ModelParallelStrategy) -> None:
    if not strategy._save_distributed_checkpoint:
        rank_zero_info("ByteCheckpointIO: ModelParallelStrategy checkpoints are saved from sharded state dicts.")
        strategy._save_distributed_checkpoint = True


def _no_setup(strategy: Strategy) -> None:
    pass


# Strategy class -> (adapter mixin, setup), or the reason it is refused. Looked up along the
# strategy's MRO, so subclasses get their base's entry.
_ADAPTERS: dict[type, Union[tuple[type, Callable[[Any], None]], str]] = {
    SingleDeviceStrategy: (_CollectiveSave, _no_setup),
    DDPStrategy: (_CollectiveSave, _no_setup),
    ModelParallelStrategy: (_ShardedInPlaceLoad, _prefer_sharded_model_parallel),
    # FSDP1's sharded state dicts hold ShardedTensor (DTensor only with a device mesh), which the
    # engine has no handler for; it would be taken for a replicated tensor. Enabling it is
    # ``(_ShardedInPlaceLoad, <set state_dict_type="sharded">)`` once the engine handles it.
    FSDPStrategy: "FSDPStrategy (FSDP1) is not supported yet; use ModelParallelStrategy (FSDP2 + TP)",
    DeepSpeedStrategy: "DeepSpeedStrategy writes its own checkpoint format",
}


def adapt(strategy: Strategy) -> None:
    """Switch ``strategy`` to the subclass carrying the adapter for its type (idempotent)."""
    base = getattr(type(strategy), _ADAPTED, type(strategy))
    entry = _lookup(base)
    adapted = _adapted_class(base)
    entry[1](strategy)
    strategy.__class__ = adapted


def unadapt(strategy: Strategy) -> None:
    base = getattr(type(strategy), _ADAPTED, None)
    if base is not None:
        strategy.__class__ = base


def _lookup(base: type) -> tuple[type, Callable[[Any], None]]:
    entry: Union[tuple, str] = "supported: single device, DDP and ModelParallelStrategy (and subclasses)"
    for klass in base.__mro__:
        if klass in _ADAPTERS:
            entry = _ADAPTERS[klass]
            break
    if isinstance(entry, str):
        raise TypeError(f"ByteCheckpointIO does not support {base.__name__}: {entry}.")
    return entry


@functools.lru_cache(maxsize=None)
def _adapted_class(base: type) -> type:
    mixin = _lookup(base)[0]
    # Same name as the original so Lightning's messages and logs read as usual.
    return type(base.__name__, (mixin, base), {_ADAPTED: base, "__module__": base.__module__,
                                              "__qualname__": base.__qualname__})


def _rebuild(base: type) -> Strategy:
    obj = base.__new__(base)
    obj.__class__ = _adapted_class(base)
    return obj


def install_strategy_hook() -> None:
    """Wrap ``Strategy.checkpoint_io``'s setter once so that assigning a ``ByteCheckpointIO``
    adapts that strategy instance (and assigning anything else later undoes it)."""
    prop = Strategy.__dict__["checkpoint_io"]
    if getattr(prop.fset, "_bytecheckpoint_hook", False):
        return
    original_setter = prop.fset

    def fset(self: Strategy, io: Any) -> None:
        from .checkpoint_io import ByteCheckpointIO

        original_setter(self, io)
        if isinstance(io, ByteCheckpointIO):
            adapt(self)
            io._collective = True
        else:
            unadapt(self)

    fset._bytecheckpoint_hook = True  # type: ignore[attr-defined]
    Strategy.checkpoint_io = prop.setter(fset)
