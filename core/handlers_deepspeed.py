"""The handler of a DeepSpeed ZeRO engine (deepspeed.runtime.engine.DeepSpeedEngine), registered
by name (deepspeed is optional and imported only when an engine is seen): saved as each rank's own
partition of every parameter's fp32 master weights, Adam moments and step (FlatShards, no
all-gather), the bf16/fp16 module weights where they differ, the optimizer's hyperparameters and
the engine's step counters; loaded in place into an engine of any world size and ZeRO stage
(deepspeed_compat.py)."""
from __future__ import annotations

from .flatten import Handler

ENGINE_CLASS = "deepspeed.runtime.engine.DeepSpeedEngine"


class DeepSpeedEngineHandler(Handler):
    def save(self, value, key, walk):
        from . import deepspeed_compat
        return walk.save(deepspeed_compat.flat_state(value, for_save=True), key)

    def load(self, value, key, walk, assign):
        from . import deepspeed_compat
        state = deepspeed_compat.flat_state(value)
        walk.load(state, key, lambda v: None)
        # plain values (hyperparameters, counters) land in `state` by then; after_load is
        # collective, and every rank of a load runs the finalizers
        walk.flat.finalizers.append(lambda: deepspeed_compat.after_load(value, state))
