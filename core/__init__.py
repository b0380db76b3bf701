"""bytecheckpoint: fast, unified, reshardable checkpoints for PyTorch (after arXiv 2407.20143).

    import bytecheckpoint as bcp
    handle = bcp.save(path, {"model": model, "optimizer": optim, "step": step}, async_save=True)
    bcp.load(path, {"model": model, "optimizer": optim, "step": 0})

    with bcp.Checkpointer(async_save=True, storage_options=opts) as ckpt:   # the engine as an object
        ckpt.save(path, state); ckpt.load(path, state)
"""
from .api import delete, inspect, is_checkpoint, keep_last, latest, load, load_full, save, stats, verify, wait_pending
from .catalog.inspect import CheckpointInfo, TensorInfo, VerifyReport
from .catalog.retention import RetentionReport
from .checkpointer import Checkpointer, default_checkpointer
from .common.errors import (
    CheckpointerClosedError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    IncompleteCheckpointError,
    MetadataError,
    PeerTimeoutError,
    RemoteRankError,
    ShardLayoutError,
    StateMismatchError,
)
from .common.options import Options
from .common.shards import FlatShard, Shard
from . import data
from .data import ElasticDataLoader, ElasticSampler
from .collectives.comm import LOCAL
from .format.metadata import FORMAT_VERSION
from .pipeline.handles import SaveHandle
from .monitor import SaveStats, StatsReport
from .pipeline.load import LoadStats
from .state.flatten import Handler, ModuleView
from .state.registry import REGISTRY
from .tiers.local import LocalTier, Restored

__version__ = "0.2.0"

__all__ = [
    "save", "load", "load_full", "latest", "keep_last", "RetentionReport", "inspect", "verify", "is_checkpoint", "delete",
    "wait_pending", "Checkpointer", "Options", "default_checkpointer", "LOCAL", "LocalTier", "Restored", "REGISTRY", "Handler", "ModuleView",
    "data", "ElasticSampler", "ElasticDataLoader",
    "Shard", "FlatShard", "SaveHandle", "CheckpointInfo", "TensorInfo", "VerifyReport", "LoadStats",
    "last_load_stats", "FORMAT_VERSION", "stats", "SaveStats", "StatsReport", "last_save_stats",
    "CheckpointError", "CheckpointerClosedError", "CheckpointExistsError", "CheckpointNotFoundError",
    "CorruptCheckpointError", "FormatVersionError", "IncompleteCheckpointError", "MetadataError", "PeerTimeoutError",
    "RemoteRankError", "ShardLayoutError", "StateMismatchError",
]


def __getattr__(name: str):
    if name == "last_load_stats":  # the default engine's last load (bcp.load); adapters: .checkpointer
        return default_checkpointer().last_load_stats
    if name == "last_save_stats":  # the default engine's newest save (bcp.save)
        return default_checkpointer().last_save_stats
    raise AttributeError(f"module 'bytecheckpoint' has no attribute {name!r}")
