"""The built-in type registry: every value type the engine knows, with its handler (Orbax's
`create_type_handler_registry`). `REGISTRY` is the one `bcp.REGISTRY` names and every Checkpointer
uses unless given `registry=`; `builtin_registry()` makes a fresh one to extend privately."""
from __future__ import annotations

import torch
from torch import nn

from . import dist_handlers
from .flatten import TypeRegistry
from .handlers_deepspeed import ENGINE_CLASS, DeepSpeedEngineHandler
from .handlers_basic import (DictHandler, FlatShardHandler, ListHandler, ObjectHandler, ShardHandler,
                             StatefulHandler, TensorHandler, TupleHandler)
from .handlers_torch import ModuleHandler, OptimizerHandler
from .shards import FlatShard, Shard


def builtin_registry() -> TypeRegistry:
    registry = TypeRegistry(stateful=StatefulHandler(), plain=ObjectHandler())
    for typ, handler in ((dict, DictHandler()), (list, ListHandler()), (tuple, TupleHandler()),
                         (torch.Tensor, TensorHandler()), (Shard, ShardHandler()), (FlatShard, FlatShardHandler()),
                         (nn.Module, ModuleHandler()), (torch.optim.Optimizer, OptimizerHandler())):
        registry.register(typ, handler)
    for typ, handler in dist_handlers.handlers():
        registry.register(typ, handler)
    registry.register_by_name(ENGINE_CLASS, DeepSpeedEngineHandler())
    return registry


#: The handlers of every value type the engine knows (extend with REGISTRY.register).
REGISTRY = builtin_registry()
