"""DeepSpeed's own checkpoint folders (`engine.save_checkpoint`, as Accelerate's and the Trainer's
DeepSpeed integrations write them) loaded into a DeepSpeed engine of any world size and ZeRO stage.

The engine reads a DeepSpeed folder as its own (core/foreign/deepspeed.py) and, for a template
holding an engine, in the engine's own form (foreign/deepspeed_view.py); stock loaders need the
saved world size. Accelerate writes model i as the tag `pytorch_model[_i]` of its output folder;
the Trainer writes `global_step<N>` in checkpoint-N (with `latest`).
"""
from __future__ import annotations

import os
from typing import Any, Dict

from ..checkpointer import Checkpointer

ACCELERATE_TAG = "pytorch_model"   # accelerate.utils.constants.MODEL_NAME


def is_folder(path: str) -> bool:
    """A DeepSpeed tag folder, or a save_dir whose `latest` names one (local file system)."""
    if not os.path.isdir(path):
        return False
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            path = os.path.join(path, f.read().strip())
    return os.path.isdir(path) and any(n.endswith("_model_states.pt") for n in os.listdir(path))


def accelerate_dirs(input_dir: str, count: int) -> Dict[int, str]:
    """Model index -> its DeepSpeed tag folder in an Accelerate save_state folder."""
    out = {}
    for i in range(count):
        path = os.path.join(input_dir, ACCELERATE_TAG if i == 0 else f"{ACCELERATE_TAG}_{i}")
        if is_folder(path):
            out[i] = path
    return out


def load_engine(ckpt: Checkpointer, folder: str, engine: Any, storage: Dict[str, Any]) -> Dict[str, Any]:
    """The folder into `engine` in place (collective over the engine's ranks); returns the
    folder's other values (DeepSpeed's counters and scheduler state under "deepspeed", and every
    client_state key)."""
    keys = [k for k in ckpt.metadata(folder, **storage).structure.get("dict", [])]
    from ..format import codec
    names = [codec.decode(k) for k, _ in keys]
    state = {k: None for k in names if k not in ("model", "optimizer")}
    state["engine"] = engine
    ckpt.load(folder, state, **storage)
    state.pop("engine")
    return state
