"""What a checkpoint holds and who writes it, per kind of Trainer training.

A registry keyed by route name, chosen from the Trainer's public flags, mirroring the branches
of the stock `_save_checkpoint` / resume:

* REPLICATED (one process, DDP, DataParallel): the model and optimizer are whole on every process.
  Like the stock Trainer (only `args.should_save` processes write `model.safetensors` /
  `optimizer.pt` / `scheduler.pt`), the writing process saves them alone (`bcp.LOCAL`) with the
  RNG states of every process gathered to it (the stock Trainer writes one RNG file per process);
  every process loads by itself. Exactly the writer's values, as the stock checkpoint holds.
* SHARDED (FSDP 1 and 2, DTensor parameters from tensor parallel loading): every process saves
  and loads its part collectively (each process's RNG states as its own plain values).
* DEEPSPEED (ZeRO 1/2/3): collective; the engine (fp32 master weights, optimizer state, bf16/fp16
  weights) is saved from each rank's own partition (core/state/deepspeed_engine.py), the scheduler
  beside it. DeepSpeed's own `save_checkpoint` does not run.
* refused: XLA/TPU and SageMaker model parallel (their checkpoints belong to their runtimes).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Optional


@dataclass(frozen=True)
class Route:
    name: str
    collective: bool            # every process saves and loads its part
    model_key: str = "model"    # the state key of the model ("engine" for DeepSpeed)
    optimizer_in_model: bool = False
    refusal: Optional[str] = None


REPLICATED = Route("replicated", collective=False)
SHARDED = Route("sharded", collective=True)
DEEPSPEED = Route("deepspeed", collective=True, model_key="engine", optimizer_in_model=True)


def _refused(name: str, why: str) -> Route:
    return Route(name, collective=True, refusal=(
        f"transformers_bytecheckpoint.attach: {why} Train on CPU/CUDA with one process, DDP, FSDP (1 or 2) or "
        "DeepSpeed ZeRO 1-3, or do not attach."))


ROUTES: Mapping[str, Route] = MappingProxyType({
    "replicated": REPLICATED,
    "sharded": SHARDED,
    "deepspeed": DEEPSPEED,
    "xla": _refused("xla", "XLA/TPU training saves through torch_xla (xm.save); bytecheckpoint has no XLA tensors."),
    "sagemaker_mp": _refused("sagemaker_mp", "SageMaker model parallel saves through smp's own checkpoints."),
})


def _holds_dtensor(model: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def name_for(trainer: Any) -> str:
    from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available

    if is_torch_xla_available():
        return "xla"
    if is_sagemaker_mp_enabled():
        return "sagemaker_mp"
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "deepspeed"
    if getattr(trainer, "is_fsdp_enabled", False) or _holds_dtensor(trainer.model):
        return "sharded"
    return "replicated"


def route_for(trainer: Any) -> Route:
    route = ROUTES[name_for(trainer)]
    if route.refusal is not None:
        raise NotImplementedError(route.refusal)
    return route
