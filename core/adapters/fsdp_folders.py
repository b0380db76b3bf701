"""Accelerate's FSDP sharded folders (also the Trainer's, which saves through Accelerate), resumed
through the engine on any layout.

With `SHARDED_STATE_DICT`, Accelerate's save_fsdp_model / save_fsdp_optimizer write each model as a
PyTorch DCP directory `pytorch_model_fsdp_<i>/` ({"model": state dict}) and each optimizer as
`optimizer_<i>/` ({"optimizer": parameter-name-keyed state}); stock Accelerate and the stock Trainer
read them back only on FSDP. The engine reads DCP directories as its own (core/foreign/dcp.py),
resharded: so a run checkpointed by either resumes through its adapter on FSDP at any process count,
on DDP or on one process. Optimizer i goes with model i, as Accelerate saves them.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from ..checkpointer import Checkpointer
from ..common.errors import CheckpointNotFoundError, StateMismatchError

MODEL_DIR, OPTIMIZER_DIR = "pytorch_model_fsdp_{}", "optimizer_{}"  # accelerate.utils.constants


def model_dirs(input_dir: str, count: int) -> Dict[int, str]:
    """Model index -> its DCP directory, for the models that have one."""
    out = {}
    for i in range(count):
        path = os.path.join(input_dir, MODEL_DIR.format(i))
        if os.path.isfile(os.path.join(path, ".metadata")):
            out[i] = path
    return out


def load(ckpt: Checkpointer, input_dir: str, models: List[Any], optimizers: List[Any], targets: List[int],
         group: Dict[str, Any], storage: Dict[str, Any]) -> List[int]:
    """Load the stock folders of models `targets` (and each one's optimizer) in place; returns the
    model indexes loaded."""
    dirs = model_dirs(input_dir, len(models))
    loaded = []
    for i in targets:
        if i not in dirs:
            raise CheckpointNotFoundError(f"{input_dir}: no {MODEL_DIR.format(i)}/ for model {i} (the folder "
                                              f"holds {sorted(MODEL_DIR.format(j) for j in dirs)})")
        ckpt.load(dirs[i], {"model": models[i]}, **group, **storage)
        loaded.append(i)
        if i < len(optimizers):
            load_optimizer(ckpt, os.path.join(input_dir, OPTIMIZER_DIR.format(i)), models[i], optimizers[i], group,
                           storage)
    return loaded


def load_optimizer(ckpt: Checkpointer, path: str, model: Any, optimizer: Any, group: Dict[str, Any],
                   storage: Dict[str, Any]) -> None:
    """The optimizer's DCP folder into `optimizer` (its parameters named by `model`); a saved
    parameter the model does not have is an error naming it."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointNotFoundError(f"{path}: the optimizer's DCP folder is missing (the model's is there)")
    inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer keeps the real one in .optimizer
    saved = {k.split("/")[2] for k in ckpt.metadata(path, **storage).tensors if k.startswith("optimizer/state/")}
    # the model names the optimizer's parameters; its own keys live in the model's folder (not loaded here)
    ckpt.load(path, {"model": model, "optimizer": inner}, strict=False, **group, **storage)
    names = {id(p): n for n, p in _named_parameters(model)}
    have = {names.get(id(p)) for p in inner.state}
    missing = sorted(n for n in saved if _plain(n) not in {_plain(h) for h in have if h})
    if missing:
        raise StateMismatchError(f"{path}: optimizer state for {missing[:5]} ({len(missing)} parameters) was not "
                                     f"loaded: the model does not have those parameters")


def _named_parameters(model: Any):
    return getattr(model, "named_parameters")()


def _plain(name: Optional[str]) -> str:
    """A parameter name without wrapper prefixes (DDP's module., torch.compile's _orig_mod.)."""
    parts = [p for p in (name or "").split(".") if p not in ("module", "_orig_mod", "_fsdp_wrapped_module")]
    return ".".join(parts)
