"""The built-in type registry: every value type the engine knows, with its handler (Orbax's
`create_type_handler_registry`). `REGISTRY` is the one `bcp.REGISTRY` names and every Checkpointer
uses unless given `registry=`; `builtin_registry()` makes a fresh one to extend privately."""
from __future__ import annotations

import torch
from torch import nn

from ..common.shards import FlatShard, Shard
from . import distributed
from .basic import (
    DictHandler,
    FlatShardHandler,
    ObjectHandler,
    ShardHandler,
    StatefulHandler,
    TensorHandler,
)
from .deepspeed_engine import ENGINE_CLASS, DeepSpeedEngineHandler
from .flatten import ModuleView, TypeRegistry
from .modules import ModuleHandler, ModuleViewHandler, OptimizerHandler
from .parts import PartsListHandler, PartsTupleHandler
from .schedulers import SchedulerHandler


def builtin_registry() -> TypeRegistry:
    registry = TypeRegistry(stateful=StatefulHandler(), plain=ObjectHandler())
    optimizers = OptimizerHandler()
    for typ, handler in ((dict, DictHandler()), (list, PartsListHandler()), (tuple, PartsTupleHandler()),
                         (torch.Tensor, TensorHandler()), (Shard, ShardHandler()), (FlatShard, FlatShardHandler()),
                         (nn.Module, ModuleHandler()), (ModuleView, ModuleViewHandler()),
                         (torch.optim.Optimizer, optimizers),
                         (torch.optim.lr_scheduler.LRScheduler, SchedulerHandler(optimizers))):
        registry.register(typ, handler)
    for typ, handler in distributed.handlers():
        registry.register(typ, handler)
    registry.register_by_name(ENGINE_CLASS, DeepSpeedEngineHandler())
    return registry


#: The handlers of every value type the engine knows (extend with REGISTRY.register).
REGISTRY = builtin_registry()
