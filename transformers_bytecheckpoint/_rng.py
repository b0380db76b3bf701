"""RNG states as the stock Trainer saves and restores them (`_save_rng_state` / `_load_rng_state`),
as plain values bytecheckpoint stores in its safe encoding (numpy arrays, no pickle).

Capturing consumes no random numbers. Restoring follows the stock rules exactly: a process
restores its own saved states when the run had several processes at save time and has several
now (rank r restores rank r's if rank r existed), or one process then and now; otherwise nothing is
restored and the stock Trainer's log line is written.
"""
from __future__ import annotations

import logging
import random
from typing import Any, Dict, Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)

#: accelerator RNGs the stock Trainer saves, by its key (xla: the XLA route is refused)
_DEVICES = ("cuda", "npu", "hpu", "mlu", "musa")


def _module(name: str) -> Optional[Any]:
    mod = getattr(torch, name, None)
    try:
        return mod if mod is not None and mod.is_available() else None
    except (AttributeError, RuntimeError):
        return None


def capture(distributed: bool) -> Dict[str, Any]:
    """This process's RNG states (stock keys; tensors as numpy arrays)."""
    states: Dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                              "cpu": torch.random.get_rng_state().numpy()}
    for name in _DEVICES:
        mod = _module(name)
        if mod is None:
            continue
        if distributed:
            states[name] = [t.numpy() for t in mod.random.get_rng_state_all()]
        else:
            states[name] = mod.random.get_rng_state().numpy()
    return states


def _tensor(value: Any) -> Any:
    if isinstance(value, list):
        return [torch.from_numpy(np.ascontiguousarray(v)) for v in value]
    return torch.from_numpy(np.ascontiguousarray(value))


def restore(states: Dict[str, Any], distributed: bool) -> None:
    from transformers.trainer_pt_utils import set_rng_state_for_device

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.random.set_rng_state(_tensor(states["cpu"]))
    for name in _DEVICES:
        mod = _module(name)
        if mod is not None and name in states:
            set_rng_state_for_device(name.upper(), mod, {name: _tensor(states[name])}, distributed)


def pick(saved: Dict[str, Any], world_size: int, process_index: int) -> Optional[Dict[str, Any]]:
    """The states this process restores under the stock rules, or None (logged as stock does)."""
    saved_world = int(saved.get("world_size", 1))
    if world_size > 1:
        if saved_world <= 1 or process_index >= saved_world:
            logger.info(f"Didn't find an RNG file for process {process_index}, if you are resuming a training that "
                        "wasn't launched in a distributed fashion, reproducibility is not guaranteed.")
            return None
    elif saved_world > 1:
        logger.info("Didn't find an RNG file, if you are resuming a training that was launched in a distributed "
                    "fashion, reproducibility is not guaranteed.")
        return None
    per_rank = saved.get("rng_per_rank")
    if per_rank is not None:       # gathered by the process that saved alone
        return per_rank[process_index]
    return saved.get("rng")        # saved by every process (its own; rank r loads rank r's)
