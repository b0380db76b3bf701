"""Who saves and loads models and optimizers, per Accelerate distributed type.

A registry keyed by `DistributedType` name that mirrors the branches of Accelerate's own
`save_state` / `load_state` (1.15, accelerator.py and checkpointing.py):

* the default branch (no distributed setup, MULTI_CPU, MULTI_GPU = DDP, MULTI_XPU, MULTI_NPU, ...):
  models and optimizers are replicated; the *main process* writes them (`save()` writes on the
  main process only, or on each node's local main with `save_on_each_node`), every calling
  process writes its own RNG file, and every process loads the files by itself. Per-process,
  so scripts may call `save_state` on the main process alone or on every process.
* FSDP: models and optimizers are sharded and saved collectively (DCP / FSDP state dicts) before
  the pre-hooks run; the hooks see no weights on save and no models on load.
* DEEPSPEED: every process saves and loads collectively, like FSDP: each model is the
  DeepSpeedEngine, saved from each rank's own ZeRO partition (the engine holds the optimizer);
  Accelerate's own `engine.save_checkpoint` / `load_checkpoint` do not run (it finds no models).
* Megatron-LM, XLA: refused (their engines checkpoint model, optimizer and scheduler themselves).

A distributed type this module does not know (a new device backend) takes the default branch,
as it does in Accelerate's `save_state`. In the default branch, models whose parameters are
DTensors (tensor parallel) are sharded all the same: they take the collective route.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Optional


@dataclass(frozen=True)
class Route:
    name: str
    sharded: bool              # state is split over processes: save and load are collective
    models_before_hooks: bool  # Accelerate handles models before its pre-hooks (FSDP, DeepSpeed)
    refusal: Optional[str] = None
    optimizers_in_models: bool = False  # the model (a DeepSpeed engine) saves its optimizer itself


PER_PROCESS = Route("replicated (per-process)", sharded=False, models_before_hooks=False)
TENSOR_PARALLEL = Route("sharded parameters (DTensor)", sharded=True, models_before_hooks=False)
FSDP = Route("FSDP", sharded=True, models_before_hooks=True)
DEEPSPEED = Route("DeepSpeed", sharded=True, models_before_hooks=True, optimizers_in_models=True)


def _refused(name: str, why: str) -> Route:
    return Route(name, sharded=True, models_before_hooks=True, refusal=(
        f"accelerate_bytecheckpoint.attach: distributed_type={name}: {why} Use no distributed setup, "
        "MULTI_CPU/MULTI_GPU (DDP), FSDP (fsdp_version 1 or 2) or DeepSpeed ZeRO 1-3, or do not attach."))


_ENGINE_OWNED = "saves models, optimizers and schedulers through its own engine checkpoint; bytecheckpoint cannot take them over."

#: DistributedType name -> Route; every other name takes PER_PROCESS (Accelerate's default branch).
ROUTES: Mapping[str, Route] = MappingProxyType({
    "FSDP": FSDP,
    "DEEPSPEED": DEEPSPEED,
    "MEGATRON_LM": _refused("MEGATRON_LM", "Megatron-LM " + _ENGINE_OWNED),
    "XLA": _refused("XLA", "XLA/TPU tensors are not supported by bytecheckpoint."),
})


def _type_name(accelerator: Any) -> str:
    dtype = accelerator.distributed_type
    return str(getattr(dtype, "name", dtype))


def check_supported(accelerator: Any) -> None:
    route = ROUTES.get(_type_name(accelerator), PER_PROCESS)
    if route.refusal is not None:
        raise NotImplementedError(route.refusal)


def route_for(accelerator: Any, models: Iterable[Any]) -> Route:
    """The route of one save_state / load_state call (models: the prepared models)."""
    route = ROUTES.get(_type_name(accelerator), PER_PROCESS)
    if route.refusal is not None:
        raise NotImplementedError(route.refusal)
    if route is FSDP and not getattr(accelerator, "is_fsdp2", False) and not engine_has_fsdp1():
        raise NotImplementedError(
            "accelerate_bytecheckpoint: FSDP1 models (FullyShardedDataParallelPlugin's default fsdp_version=1) "
            f"need a bytecheckpoint with FSDP1 support; this one ({_engine_version()}) has none. Upgrade "
            "bytecheckpoint, or use FullyShardedDataParallelPlugin(fsdp_version=2).")
    if route is PER_PROCESS and _holds_dtensor(models):
        return TENSOR_PARALLEL
    return route


def _holds_dtensor(models: Iterable[Any]) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed tensors: nothing is sharded
        return False
    return any(isinstance(p, DTensor) for m in models for p in m.parameters())


def engine_has_fsdp1() -> bool:
    """The engine saves FSDP1 (FullyShardedDataParallel) modules through its flat-shard route."""
    return importlib.util.find_spec("bytecheckpoint.state.fsdp1") is not None


def _engine_version() -> str:
    import bytecheckpoint

    return f"bytecheckpoint {getattr(bytecheckpoint, '__version__', '?')}"
