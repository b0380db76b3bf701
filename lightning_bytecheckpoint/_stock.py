"""Lightning's own sharded checkpoint directories, read through the engine on any strategy.

DeepSpeedStrategy's stock directories (DeepSpeed's `save_checkpoint` with Lightning's checkpoint
dict as its client state) are read the same way (core/foreign/deepspeed.py): `read_deepspeed`
returns Lightning's form for a strategy without DeepSpeed; `deepspeed_template` is the load
template that restores a DeepSpeed engine of another world size (strategies.py).

FSDPStrategy(state_dict_type="sharded") and ModelParallelStrategy write a PyTorch DCP directory
({"model": state dict, "optimizer_<i>": parameter-name-keyed optimizer state}) plus `meta.pt`
(everything else of the checkpoint, torch.save'd by rank 0). Stock Lightning resumes it only with
the strategy that wrote it (a plain device gets IsADirectoryError). The engine reads the DCP part
as one of its own (core/foreign/dcp.py), so it is returned here in Lightning's checkpoint form with
full tensors, for any strategy and device count to restore.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch

import bytecheckpoint as bcp

from . import _state

META_FILE = "meta.pt"  # lightning.fabric.strategies.fsdp._METADATA_FILENAME
_OPTIMIZER = "optimizer_"


def is_sharded_dir(path: Any) -> bool:
    """A Lightning sharded checkpoint directory (DCP + meta.pt) on the local file system."""
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else ""
    return bool(text) and "://" not in text and os.path.isfile(os.path.join(text, META_FILE)) and \
        os.path.isfile(os.path.join(text, ".metadata"))


def is_deepspeed_dir(path: Any) -> bool:
    """A DeepSpeed checkpoint folder on the local file system: a save_dir with `latest`, or a tag folder."""
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else ""
    if not text or "://" in text or not os.path.isdir(text):
        return False
    if os.path.isfile(os.path.join(text, "latest")):
        with open(os.path.join(text, "latest")) as f:
            text = os.path.join(text, f.read().strip())
    return os.path.isdir(text) and any(n.endswith("_model_states.pt") for n in os.listdir(text))


_DEEPSPEED_VIEW = ("model", "optimizer", "deepspeed")  # the reader's own keys; the rest is Lightning's dict


def deepspeed_template(saved_keys: Any, engine_key: str, engine: Any) -> Dict[str, Any]:
    """Lightning's checkpoint keys (DeepSpeed's client state) to receive, and the engine."""
    template: Dict[str, Any] = {k: None for k in saved_keys if k not in _DEEPSPEED_VIEW}
    template[engine_key] = engine
    template["deepspeed"] = None
    return template


def read_deepspeed(checkpointer: bcp.Checkpointer, path: Any, weights_only: Optional[bool]) -> Dict[str, Any]:
    """A stock DeepSpeedStrategy directory as Lightning's dict: the client state (loops, callbacks,
    schedulers, step), `state_dict` (fp32 master weights and buffers, full) and `optimizer_states`
    (by position, in DeepSpeed's parameter order, which is the optimizer's)."""
    saved = checkpointer.load_full(os.fspath(path), allow_pickle=weights_only is not True, process_group=bcp.LOCAL)
    checkpoint = {k: v for k, v in saved.items() if k not in _DEEPSPEED_VIEW}
    checkpoint["state_dict"] = saved["model"]
    by_names = {"state": saved["optimizer"]["state"], "param_groups": saved["deepspeed"]["param_groups"]}
    checkpoint["optimizer_states"] = [_state.names_to_positions(by_names)]
    return checkpoint


def read(checkpointer: bcp.Checkpointer, path: Any, weights_only: Optional[bool]) -> Dict[str, Any]:
    """The checkpoint as Lightning's dict: meta.pt's entries, `state_dict` (full tensors) and
    `optimizer_states` (keyed by position, as a torch optimizer's state_dict() is)."""
    text = os.fspath(path)
    saved = checkpointer.load_full(text, allow_pickle=weights_only is False, process_group=bcp.LOCAL)
    if "model" not in saved:
        raise bcp.StateMismatchError(f"{text}: a DCP checkpoint with {META_FILE} but no 'model' entry (keys "
                                     f"{sorted(saved)}); not a Lightning sharded checkpoint")
    checkpoint: Dict[str, Any] = torch.load(os.path.join(text, META_FILE), map_location="cpu",
                                            weights_only=weights_only)
    checkpoint["state_dict"] = saved["model"]
    optimizers = sorted((int(k[len(_OPTIMIZER):]), v) for k, v in saved.items()
                        if k.startswith(_OPTIMIZER) and k[len(_OPTIMIZER):].isdigit())
    if optimizers:
        checkpoint["optimizer_states"] = [_state.names_to_positions(osd) if _state.keyed_by_names(osd) else osd
                                          for _, osd in optimizers]
    return checkpoint
