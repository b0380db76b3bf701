"""``Fabric(plugins=[ByteCheckpointIO()])``: Fabric's strategies.

Fabric's single-device and DDP strategies call the plugin like the Trainer's (``fabric.save``:
global rank 0 with the state converted to state dicts, which it holds whole; ``fabric.load``:
every rank), so they need nothing. Its sharded strategies (``FSDPStrategy``,
``ModelParallelStrategy``) refuse any CheckpointIO (their ``checkpoint_io`` getter and setter
raise) and write torch.distributed.checkpoint directories themselves. For those the setter is
wrapped (_compat.py) so that assigning a ``ByteCheckpointIO`` stores it and switches the strategy
instance to a subclass whose ``save_checkpoint`` / ``load_checkpoint`` go through the engine:
every rank saves its part of the modules and optimizers in ``state``; ``fabric.load(path, state)``
loads them in place into their current sharding (another world size or strategy is fine) and
the rest whole. Checkpoints have the Trainer's layout: model state dicts keyed by parameter
name, optimizer states keyed by parameter position, so they load under any strategy.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Union

from lightning.fabric.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.fabric.strategies import Strategy as FabricStrategy
from lightning.fabric.utilities.types import _PATH
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from . import _class_switch, _compat, _state

from .checkpoint_io import ByteCheckpointIO



def install_hooks() -> None:
    _compat.hook_checkpoint_io_setter(FabricStrategy, _on_assign)
    for cls in (FSDPStrategy, ModelParallelStrategy):  # their own checkpoint_io property refuses plugins
        _compat.hook_checkpoint_io_setter(cls, _on_assign)


def _on_assign(strategy: Any, io: Any) -> bool:
    if not isinstance(io, ByteCheckpointIO):
        unadapt(strategy)
        return False
    base = _class_switch.base_of(strategy)
    if any(issubclass(base, cls) for cls in ADAPTERS):
        ADAPTERS[next(cls for cls in ADAPTERS if issubclass(base, cls))](strategy)
        _compat.store_checkpoint_io(strategy, io)
        _class_switch.switch(strategy, _ShardedFabric)
        io.connect(strategy, _no_template)
        return True
    io.connect(strategy, _no_template)
    return False


def _no_template(io: Any, path: Any) -> None:
    """Fabric loads through its strategy's load_checkpoint, not the Trainer's in-place path."""
    return None


class _ShardedFabric(FabricStrategy):
    """Mixin before Fabric's FSDPStrategy / ModelParallelStrategy (never instantiated)."""

    @property  # type: ignore[override]
    def checkpoint_io(self) -> "ByteCheckpointIO":
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        if not _on_assign(self, io):
            raise NotImplementedError(f"The `{type(self).__name__}` does not support setting a `CheckpointIO` plugin.")

    @override
    def save_checkpoint(self, path: _PATH, state: Dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[Dict[str, Callable[[str, Any], bool]]] = None) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        io = self.checkpoint_io
        path = self.broadcast(str(path))
        module = _sharded_module(state)
        converted: Dict[str, Any] = {}
        for key, obj in state.items():
            if isinstance(obj, nn.Module):
                value = get_model_state_dict(obj)
            elif isinstance(obj, Optimizer):
                value = _state.names_to_positions(get_optimizer_state_dict(module, obj))
            elif callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
                value = obj.state_dict()
            else:
                value = obj
            if filter and key in filter and isinstance(value, dict):
                value = {k: v for k, v in value.items() if filter[key](k, v)}
            converted[key] = value
        io.save(converted, path, io._options(storage_options), process_group=None)  # every rank

    @override
    def load_checkpoint(self, path: _PATH, state: Optional[Union[nn.Module, Optimizer, Dict[str, Any]]] = None,
                        strict: bool = True, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict, set_model_state_dict,
                                                             set_optimizer_state_dict)

        io = self.checkpoint_io
        path = self.broadcast(str(path))
        if not io.is_bytecheckpoint(path):
            return super().load_checkpoint(path, state=state, strict=strict, weights_only=weights_only)
        if not state:
            return io.read(path, weights_only=weights_only)
        if isinstance(state, nn.Module):  # fabric.load_raw(path, model): the file is a model state dict
            template = get_model_state_dict(state)
            io.load(path, template, strict=strict, weights_only=weights_only, process_group=None)
            set_model_state_dict(state, template, options=StateDictOptions(strict=strict))
            return {}
        saved = io.saved_keys(path)
        missing = [k for k in state if k not in saved]
        if strict and missing:
            raise KeyError(f"The requested state contains a key '{missing[0]}' that does not exist in the loaded "
                           f"checkpoint. To disable strict loading, set `strict=False`.")
        module = _sharded_module(state)
        template: Dict[str, Any] = {key: None for key in saved}
        order: Dict[str, list] = {}
        for key, obj in state.items():
            if key not in template:
                continue
            if isinstance(obj, nn.Module):
                template[key] = get_model_state_dict(obj)
            elif isinstance(obj, Optimizer):
                live = get_optimizer_state_dict(module, obj)
                order[key] = [n for g in live["param_groups"] for n in g["params"]]
                template[key] = _state.names_to_positions(live)
        io.load(path, template, strict=False, weights_only=weights_only, process_group=None)
        for key, obj in list(state.items()):
            if key not in template:
                continue
            value = template.pop(key)
            if isinstance(obj, nn.Module):
                set_model_state_dict(obj, value, options=StateDictOptions(strict=strict))
            elif isinstance(obj, Optimizer):
                set_optimizer_state_dict(module, obj, _state.positions_to_names(value, order[key]))
            elif callable(getattr(obj, "load_state_dict", None)) and callable(getattr(obj, "state_dict", None)):
                obj.load_state_dict(value)
            else:
                state[key] = value
        return template  # what the checkpoint holds beyond the requested state

    @override
    def teardown(self) -> None:
        try:
            self.checkpoint_io.teardown()
        finally:
            super().teardown()

    @override
    def __reduce_ex__(self, protocol: int) -> Any:
        return _class_switch.reduce(self, _ShardedFabric)


def _sharded_module(state: Dict[str, Any]) -> Optional[nn.Module]:
    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    if len(modules) > 1:
        raise ValueError("ByteCheckpointIO with a sharded Fabric strategy saves one model per checkpoint (its "
                         "optimizers are keyed through it); save several models to different paths")
    return modules[0] if modules else None


def _check_engine_fsdp(strategy: Any) -> None:

    if not _state.engine_handles_sharded_tensor():
        raise TypeError("ByteCheckpointIO does not support Fabric's FSDPStrategy with this bytecheckpoint engine: it "
                        "has no handler for FSDP1's ShardedTensor state dicts yet. Use ModelParallelStrategy (FSDP2 "
                        "fully_shard, tensor parallel) with Fabric, or Lightning's default checkpointing for FSDP.")


def _no_check(strategy: Any) -> None:
    pass


# Fabric strategy class -> check run when the plugin is assigned. Others need no adapter.
ADAPTERS: Dict[type, Callable[[Any], None]] = {
    ModelParallelStrategy: _no_check,
    FSDPStrategy: _check_engine_fsdp,
}


unadapt = _class_switch.unswitch
