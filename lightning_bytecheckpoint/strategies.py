"""Where ``ByteCheckpointIO`` meets its strategy, and the adapters of strategies that bypass it.

Lightning's single-device and DDP strategies need nothing: they call the plugin with state that
the calling rank holds whole, which it saves alone (``bcp.LOCAL``), and every rank calls the
plugin to load. The plugin only learns which strategy it serves (a weak reference), so that a
Trainer's load can read the weights straight into the module.

Sharded strategies build their checkpoints with torch.distributed.checkpoint and never call the
plugin (``FSDPStrategy`` with ``state_dict_type="sharded"``, ``ModelParallelStrategy``), nor can they
load a directory they did not write. For those, the strategy *instance* the plugin is given to
is switched to a subclass carrying a small adapter (looked up in ``ADAPTERS`` along the MRO):
every rank saves its part through the engine, and loads go in place into the current sharding.

The meeting point is the ``checkpoint_io`` property setter, wrapped once (_compat.py): Lightning's
connectors assign the plugin there in every process before anything runs. CheckpointIO has no
hook that runs before the first save and no reference to its strategy, so no public hook serves.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Union

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from . import _class_switch, _compat, _state, _stock
from . import warm_up as _warm_up

from .checkpoint_io import ByteCheckpointIO



def install_hooks() -> None:
    """Idempotent: the hook on Lightning's strategies' checkpoint_io setter (the package's
    __init__ calls it, with the Fabric and load_from_checkpoint hooks)."""
    _compat.hook_checkpoint_io_setter(Strategy, _on_assign)


def _on_assign(strategy: Any, io: Any) -> bool:
    if isinstance(io, ByteCheckpointIO):
        adapt(strategy)
        io.connect(strategy, in_place_template)
        _warm_up.arm(io, strategy)  # staging allocated after the first optimizer step (async saves)
    else:
        unadapt(strategy)
    return False  # the original setter stores the plugin


# ---------------------------------------------------------------- the Trainer's in-place load (DDP, 1 device)

def in_place_template(io: "ByteCheckpointIO", path: _PATH) -> Optional[Dict[str, Any]]:
    """For a Trainer on one device or DDP: a load template whose ``state_dict`` entries are the
    module's own tensors, so the weights are read straight into the model (no second copy), and
    ``None`` placeholders for every other saved key. None where that would not be exactly what
    Lightning does: no strategy known, a sharded adapter in charge, a module that edits the
    checkpoint in ``on_load_checkpoint`` (it may drop or rename weights), or saved weights that
    differ from the module's in names, shapes or dtypes, or a load that is not the Trainer's restore."""
    strategy = io.strategy
    if strategy is None or _class_switch.is_adapted(strategy):
        return None
    module = getattr(strategy, "lightning_module", None)
    if module is None or is_overridden("on_load_checkpoint", module) or not _restoring(module, path):
        return None
    sd = module.state_dict()
    if not sd or any(not isinstance(v, torch.Tensor) or v.is_meta for v in sd.values()):
        return None
    md = io.checkpointer.metadata(str(path))
    prefix = "state_dict/"
    saved = {k[len(prefix):]: t for k, t in md.tensors.items() if k.startswith(prefix)}
    if set(saved) != set(sd) or any(tuple(saved[k].shape) != tuple(v.shape) or
                                    saved[k].dtype != str(v.dtype).removeprefix("torch.") for k, v in sd.items()):
        return None
    template: Dict[str, Any] = {key: None for key in io.saved_keys(path)}
    template["state_dict"] = sd
    return template


def _restoring(module: Any, path: _PATH) -> bool:
    """The Trainer is restoring from ``path`` (its public ``ckpt_path``), so Lightning is about to
    overwrite the module's weights with these anyway; any other load_checkpoint call (a callback
    peeking at a checkpoint) must leave the live model alone."""
    try:
        ckpt_path = module.trainer.ckpt_path
    except (RuntimeError, AttributeError):  # not attached to a Trainer
        return False
    return ckpt_path is not None and _state.key_of(ckpt_path) == _state.key_of(path)


# ---------------------------------------------------------------- sharded strategies (Trainer)

class _ShardedSave(Strategy):
    """Every rank saves its part; teardown waits for pending saves (FSDP/ModelParallel's own
    teardown never calls the plugin's). A mixin placed before the strategy class; it derives from
    ``Strategy`` (never instantiated) so the combined class keeps the instance layout."""

    @override
    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        io: ByteCheckpointIO = self.checkpoint_io
        path = self._save_path(filepath)
        options = io._options(storage_options)
        if not self._saves_parts():  # gathered state ("full"): rank 0 holds it whole and saves it alone
            if self.is_global_zero:
                io.save(checkpoint, path, options, process_group=_LOCAL())
            return
        checkpoint = dict(checkpoint)
        checkpoint["optimizer_states"] = [_state.names_to_positions(s) if _state.keyed_by_names(s) else s
                                          for s in checkpoint.get("optimizer_states", [])]
        io.save(checkpoint, path, options, process_group=None)  # every rank of the default group

    def _save_path(self, filepath: _PATH) -> str:
        """Rank 0's path on every rank; refused unless the engine stores there."""
        path = self.broadcast(str(filepath))
        if not _state.is_bcp_path(path):
            raise ValueError(f"{type(self).__name__} with ByteCheckpointIO saves to local paths, file://, s3:// or "
                             f"gs://, not {path!r}")
        return path

    def _saves_parts(self) -> bool:
        return True

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

    @override
    def teardown(self) -> None:
        try:
            self.checkpoint_io.teardown()  # while the process group is still up
        finally:
            super().teardown()

    @override
    def __reduce_ex__(self, protocol: int) -> Any:  # ddp_spawn pickles the trainer
        return _class_switch.reduce(self, _lookup(_class_switch.base_of(self))[0])


class _ShardedLoad(_ShardedSave):
    """Loads in place into the live (sharded) model and optimizers; resharding is the engine's."""

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        path = self.broadcast(str(checkpoint_path))
        io: ByteCheckpointIO = self.checkpoint_io
        if not io.is_bytecheckpoint(path):
            return super().load_checkpoint(path, weights_only=weights_only)  # the strategy's own formats
        if self._loads_sharded():
            return _load_in_place(self, io, path, weights_only)
        return _load_full_into(self, io, path, weights_only)

    def _loads_sharded(self) -> bool:
        return True


class _FSDPAdapter(_ShardedLoad):
    def _saves_parts(self) -> bool:
        return _compat.fsdp_state_dict_type(self) == "sharded"

    def _loads_sharded(self) -> bool:
        return _state.engine_handles_sharded_tensor()


def _load_in_place(strategy: Strategy, io: "ByteCheckpointIO", path: str, weights_only: Optional[bool]) -> Dict:
    """Model and optimizer states as templates in their current layout (DTensor / ShardedTensor),
    loaded in place with one collective load that reshards; every other key comes back whole."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    module = strategy.lightning_module
    fitting = _fitting(module)
    strict_model = module.strict_loading
    state: Dict[str, Any] = {key: None for key in io.saved_keys(path)}
    strict = strict_model
    state["state_dict"] = get_model_state_dict(strategy.model)
    names = []
    if "optimizer_states" in state and fitting and strategy.optimizers:
        live = [get_optimizer_state_dict(strategy.model, opt) for opt in strategy.optimizers]
        names = [[n for g in osd["param_groups"] for n in g["params"]] for osd in live]
        state["optimizer_states"] = [_state.names_to_positions(osd) for osd in live]
    else:  # evaluating: optimizer states are not read, so not every saved key is matched
        state.pop("optimizer_states", None)
        strict = False
    state = io.load(path, state, strict=strict, weights_only=weights_only, process_group=None)
    set_model_state_dict(strategy.model, state.pop("state_dict"), options=StateDictOptions(strict=strict_model))
    for opt, osd, order in zip(strategy.optimizers, state.pop("optimizer_states", []) if names else [], names):
        set_optimizer_state_dict(strategy.model, opt, _state.positions_to_names(osd, order))
    return state


def _load_full_into(strategy: Strategy, io: "ByteCheckpointIO", path: str, weights_only: Optional[bool]) -> Dict:
    """Every rank reads the full state and the strategy shards it (FSDP1 while the engine has no
    ShardedTensor support: what FSDPStrategy does with a full .ckpt file)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    module = strategy.lightning_module
    checkpoint = io.read(path, weights_only=weights_only)
    full = StateDictOptions(full_state_dict=True, strict=module.strict_loading)
    set_model_state_dict(strategy.model, checkpoint.pop("state_dict"), options=full)
    saved = checkpoint.pop("optimizer_states", None)
    if saved is not None and _fitting(module) and strategy.optimizers:
        if len(saved) != len(strategy.optimizers):
            raise RuntimeError(f"The checkpoint holds {len(saved)} optimizer states, the model configures "
                               f"{len(strategy.optimizers)} optimizers; resume with the same optimizers")
        for opt, osd in zip(strategy.optimizers, saved):
            if not _state.keyed_by_names(osd):
                live = get_optimizer_state_dict(strategy.model, opt)
                osd = _state.positions_to_names(osd, [n for g in live["param_groups"] for n in g["params"]])
            set_optimizer_state_dict(strategy.model, opt, osd, options=StateDictOptions(full_state_dict=True))
    return checkpoint


def _fitting(module: Any) -> bool:
    try:
        trainer = module.trainer
    except RuntimeError:  # not attached to a Trainer
        return False
    return trainer is not None and trainer.state.fn == TrainerFn.FITTING


def _LOCAL() -> Any:
    import bytecheckpoint as bcp

    return bcp.LOCAL


def _sharded_model_parallel(strategy: ModelParallelStrategy) -> None:
    _compat.use_sharded_state_dicts(strategy)


def _check_fsdp(strategy: FSDPStrategy) -> None:
    kind = _compat.fsdp_state_dict_type(strategy)
    if kind == "sharded" and not _state.engine_handles_sharded_tensor():
        raise TypeError(
            "ByteCheckpointIO does not support FSDPStrategy(state_dict_type='sharded') with this bytecheckpoint "
            "engine: it has no handler for FSDP1's ShardedTensor state dicts yet. Use state_dict_type='full' (rank 0 "
            "saves the gathered state, every rank loads it into its shards) or ModelParallelStrategy (FSDP2).")


ENGINE_KEY = "deepspeed_engine"  # loading.DEEPSPEED_ENGINE_KEY: load_from_checkpoint rebuilds state_dict from it


class _DeepSpeedAdapter(_ShardedSave):
    """DeepSpeedStrategy's own save/load write DeepSpeed's engine format and never call the plugin.
    Here every rank saves the engine (its own partition of fp32 master weights, Adam moments, step,
    bf16/fp16 weights; bytecheckpoint's DeepSpeed support) with the rest of Lightning's checkpoint
    dict; a load restores the engine in place, on any number of processes and ZeRO stage, and
    returns the rest (loops, callbacks, schedulers), as DeepSpeedStrategy.load_checkpoint does."""

    @override
    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        io: ByteCheckpointIO = self.checkpoint_io
        path = self._save_path(filepath)
        # DeepSpeed's module and optimizer state dicts are this rank's view; the engine holds it all
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        rest[ENGINE_KEY] = self.deepspeed_engine
        io.save(rest, path, io._options(storage_options), process_group=None)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        path = self.broadcast(str(checkpoint_path))
        io: ByteCheckpointIO = self.checkpoint_io
        if _stock.is_deepspeed_dir(path):  # DeepSpeed's own directory: into this engine, at any world size
            state = _stock.deepspeed_template(io.saved_keys(path), ENGINE_KEY, self.deepspeed_engine)
            # unpickled in full unless weights_only=True, as DeepSpeed's own loader does
            state = io.load(path, state, weights_only=weights_only is True, process_group=None)
            state.pop(ENGINE_KEY)
            state.pop("deepspeed")
            return state
        if not io.is_bytecheckpoint(path):
            return super().load_checkpoint(path, weights_only=weights_only)
        state: Dict[str, Any] = {key: None for key in io.saved_keys(path)}
        if ENGINE_KEY not in state:
            raise ValueError(f"{path} was not saved by DeepSpeedStrategy (no {ENGINE_KEY!r}); load it with the "
                             f"strategy that saved it, or through LightningModule.load_from_checkpoint")
        state[ENGINE_KEY] = self.deepspeed_engine
        state = io.load(path, state, weights_only=weights_only, process_group=None)
        state.pop(ENGINE_KEY)
        return state


def _check_deepspeed(strategy: DeepSpeedStrategy) -> None:
    if strategy.config.get("zero_optimization", {}).get("stage", 0) not in (1, 2, 3):
        raise TypeError("ByteCheckpointIO with DeepSpeedStrategy needs ZeRO stage 1, 2 or 3 (the engine saves each "
                        "rank's partition); with stage 0 use DDPStrategy, which it supports directly")


# Strategy class -> (adapter mixin, check/setup run when the plugin is assigned), or the reason
# it is refused. Looked up along the strategy's MRO. Strategies not listed (single device, DDP,
# ddp_spawn and their subclasses) need no adapter.
ADAPTERS: Dict[type, Union[tuple, str]] = {
    ModelParallelStrategy: (_ShardedLoad, _sharded_model_parallel),
    FSDPStrategy: (_FSDPAdapter, _check_fsdp),
    DeepSpeedStrategy: (_DeepSpeedAdapter, _check_deepspeed),
}


def adapt(strategy: Any) -> None:
    """Switch ``strategy`` to the subclass carrying its adapter, if its type needs one."""
    entry = _lookup(_class_switch.base_of(strategy))
    if entry is None:
        return
    entry[1](strategy)
    _class_switch.switch(strategy, entry[0])


unadapt = _class_switch.unswitch


def _lookup(base: type) -> Optional[tuple]:
    for klass in base.__mro__:
        if klass in ADAPTERS:
            entry = ADAPTERS[klass]
            if isinstance(entry, str):
                raise TypeError(f"ByteCheckpointIO does not support {base.__name__}: {entry}.")
            return entry
    return None
