"""bytecheckpoint: fast, unified, reshardable checkpoints for PyTorch (after arXiv 2407.20143).

    import bytecheckpoint as bcp
    handle = bcp.save(path, {"model": model, "optimizer": optim, "step": step}, async_save=True)
    bcp.load(path, {"model": model, "optimizer": optim, "step": 0})
"""
from .errors import (CheckpointError, CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError,
                     FormatVersionError, IncompleteCheckpointError, MetadataError, RemoteRankError,
                     ShardLayoutError, StateMismatchError)
from .shards import FlatShard, Shard
from .saver import SaveHandle, save, wait_pending
from .loader import load, load_full, last_load_stats
from .inspect import CheckpointInfo, TensorInfo, delete, inspect, is_checkpoint, verify
from .metadata import FORMAT_VERSION
from .retention import RetentionReport, keep_last

__version__ = "0.1.0"

__all__ = [
    "save", "load", "load_full", "keep_last", "RetentionReport", "inspect", "verify", "is_checkpoint", "delete", "wait_pending",
    "Shard", "FlatShard", "SaveHandle", "CheckpointInfo", "TensorInfo", "last_load_stats", "FORMAT_VERSION",
    "CheckpointError", "CheckpointExistsError", "CheckpointNotFoundError", "CorruptCheckpointError",
    "FormatVersionError", "IncompleteCheckpointError", "MetadataError", "RemoteRankError", "ShardLayoutError",
    "StateMismatchError",
]
