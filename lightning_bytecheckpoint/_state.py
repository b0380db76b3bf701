"""Pure helpers on checkpoint dicts: which paths bytecheckpoint stores, sharded values, RNG
state as plain values, and optimizer state keyed by parameter position or name."""
from __future__ import annotations

import os
import random
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from bytecheckpoint.state.optimizer_form import keyed_by_names, names_to_positions  # noqa: F401 (used by the adapters)

#: URL schemes whose checkpoints bytecheckpoint writes, as Lightning users mean them. Others
#: (memory://, hdfs://, az://, ...) are fsspec file systems: see ByteCheckpointIO. http(s):// is
#: read-only: a bytecheckpoint directory served there is loaded by the engine, a .ckpt file by
#: Lightning.
BCP_SCHEMES = ("file", "s3", "gs")
READ_ONLY_SCHEMES = ("http", "https")


def scheme(path: Any) -> str:
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    return text.split("://", 1)[0].lower() if "://" in text else "file"


def is_bcp_path(path: Any) -> bool:
    return scheme(path) in BCP_SCHEMES


def is_ours(checkpointer: Any, path: Any, **kwargs: Any) -> bool:
    """A committed checkpoint in bytecheckpoint's own format. Other formats the engine reads (a
    Lightning FSDP sharded directory is a PyTorch DCP one) stay Lightning's to load as it does."""
    from bytecheckpoint import CheckpointError
    try:
        return checkpointer.metadata(str(path), **kwargs).foreign is None
    except CheckpointError:  # not a checkpoint, unreadable: not ours to load (Lightning says why)
        return False


def key_of(path: Any) -> str:
    """A comparable form of a checkpoint path (absolute for local paths)."""
    text = str(path)
    if "://" not in text:
        return os.path.abspath(text)
    return text[len("file://"):] if text.startswith("file://") else text.rstrip("/")


# ---------------------------------------------------------------- sharded values

def is_sharded_value(value: Any) -> bool:
    """A value that holds only a part of a tensor (a save of it needs every holder)."""
    from bytecheckpoint import FlatShard, Shard

    if isinstance(value, (Shard, FlatShard)):
        return True
    try:
        from torch.distributed.tensor import DTensor, Replicate
    except ImportError:  # pragma: no cover
        DTensor = None
    if DTensor is not None and isinstance(value, DTensor):
        return any(not isinstance(p, Replicate) for p in value.placements)
    return any(c.__name__ == "ShardedTensor" for c in type(value).__mro__)


def find_sharded(value: Any, key: str = "", depth: int = 0) -> Optional[str]:
    """The key of the first sharded value in a nested checkpoint, or None."""
    if depth > 32:
        return None
    if is_sharded_value(value):
        return key or "<root>"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for k, v in items:
        found = find_sharded(v, f"{key}/{k}" if key else str(k), depth + 1)
        if found:
            return found
    return None


# ---------------------------------------------------------------- RNG state (public APIs only)

def collect_rng() -> Dict[str, Any]:
    """This process's torch / CUDA / numpy / python RNG states as plain values (numpy arrays,
    tuples): per-rank values for the engine, not tensors (which it would take as replicated)."""
    states: Dict[str, Any] = {
        "torch": torch.get_rng_state().numpy(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        states["torch.cuda"] = [s.numpy() for s in torch.cuda.get_rng_state_all()]
    return states


def restore_rng(states: Dict[str, Any]) -> None:
    torch.set_rng_state(torch.as_tensor(np.asarray(states["torch"]), dtype=torch.uint8))
    if "numpy" in states:
        np.random.set_state(_tuple(states["numpy"]))
    if "python" in states:
        random.setstate(_tuple(states["python"]))
    cuda = states.get("torch.cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([torch.as_tensor(np.asarray(s), dtype=torch.uint8) for s in cuda])


def _tuple(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tuple(v) for v in value)
    if isinstance(value, tuple):
        return tuple(_tuple(v) for v in value)
    return value


# ---------------------------------------------------------------- optimizer state keys

def positions_to_names(osd: Dict[str, Any], names: List[str]) -> Dict[str, Any]:
    """The inverse, given the parameter names in the live optimizer's order."""
    return {
        **{k: v for k, v in osd.items() if k not in ("state", "param_groups")},
        "state": {names[i]: s for i, s in osd["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]],
    }


# ---------------------------------------------------------------- resume paths (local tier)

#: ``ckpt_path`` prefix that ``ByteCheckpointIO.load_checkpoint`` resolves to the newest complete
#: checkpoint of the local tier or under the persistent directory that follows it.
RESTORE_PREFIX = "bytecheckpoint-restore://"


def resume_path(persistent_dir: Optional[str] = None) -> str:
    """The ``ckpt_path`` to pass to ``Trainer.fit`` to resume from the newest complete checkpoint
    these ranks can restore: the local tier of the plugin's checkpointer (own parts and peer
    replicas, resharded to the current world, no persistent read) or the newest complete
    checkpoint under ``persistent_dir`` (e.g. ``ModelCheckpoint``'s dirpath), whichever is newer."""
    target = "" if persistent_dir is None else str(persistent_dir)
    if target and "://" not in target:
        target = os.path.abspath(target)
    return RESTORE_PREFIX + target


def is_resume_path(path: Any) -> bool:
    return str(path).startswith(RESTORE_PREFIX)


def persistent_of(path: Any) -> Optional[str]:
    rest = str(path)[len(RESTORE_PREFIX):]
    return rest or None


def engine_handles_sharded_tensor() -> bool:
    """bytecheckpoint's type registry has a handler for FSDP1's ShardedTensor (it is a
    torch.Tensor subclass: without one it would be taken for a whole, replicated tensor)."""
    import bytecheckpoint as bcp

    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # pragma: no cover
        return False
    mro = ShardedTensor.__mro__
    return any(k in bcp.REGISTRY for k in mro[:mro.index(torch.Tensor)])
