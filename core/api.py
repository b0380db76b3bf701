"""The module-level API: thin calls on the default Checkpointer (built from the environment on
first use). Use a `bcp.Checkpointer` of your own for other options or several configurations."""
from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Sequence

from .catalog.inspect import CheckpointInfo, VerifyReport
from .catalog.retention import RetentionReport
from .catalog.retention import latest as _latest
from .checkpointer import default_checkpointer
from .monitor import StatsReport
from .pipeline.handles import SaveHandle


def save(path, state: Dict[str, Any], *, async_save: Optional[bool] = None, process_group=None,
         overwrite: bool = False, storage_options: Optional[Mapping[str, Any]] = None,
         step: Optional[int] = None, safetensors: Sequence[str] = (),
         before_commit: Optional[Callable[[Any], None]] = None, optimizers: Sequence[Any] = (),
         async_staging: Optional[bool] = None) -> SaveHandle:
    """Save `state` to `path` from every rank of `process_group` (collective). async_save None:
    the default engine's setting (BCP_ASYNC_SAVE, else synchronous). step: the training step,
    recorded in the metadata; `latest` orders checkpoints by it. safetensors, before_commit:
    see Checkpointer.save (key paths written as safetensors files; docs/format.md, format 6).
    async_staging, optimizers: see Checkpointer.save (docs/async_staging.md)."""
    return default_checkpointer().save(path, state, overwrite=overwrite, async_save=async_save,
                                       process_group=process_group, storage_options=storage_options, step=step,
                                       safetensors=safetensors, before_commit=before_commit, optimizers=optimizers,
                                       async_staging=async_staging)


def load(path, state: Dict[str, Any], *, process_group=None, strict: bool = True,
         storage_options: Optional[Mapping[str, Any]] = None, allow_pickle: bool = False) -> Dict[str, Any]:
    """Load a checkpoint into `state` in place (collective); returns `state`."""
    return default_checkpointer().load(path, state, strict=strict, allow_pickle=allow_pickle,
                                       process_group=process_group, storage_options=storage_options)


def load_full(path, *, keys: Optional[Sequence[str]] = None, process_group=None,
              storage_options: Optional[Mapping[str, Any]] = None, allow_pickle: bool = False,
              per_rank: bool = False) -> Any:
    """The saved state as nested dicts/lists with full CPU tensors and plain values (no template).
    Plain values that differ between the saved ranks are merged (dicts: every rank's keys);
    per_rank=True returns a list, each saved rank's state with its own plain values."""
    return default_checkpointer().load_full(path, keys=keys, allow_pickle=allow_pickle, process_group=process_group,
                                            storage_options=storage_options, per_rank=per_rank)


def wait_pending() -> None:
    """Wait for every in-flight async save of bcp.save; re-raise the first failure."""
    default_checkpointer().wait()


def inspect(path, storage_options: Optional[Mapping[str, Any]] = None) -> CheckpointInfo:
    """What a checkpoint holds, from its metadata alone. An incomplete one is reported, not raised."""
    return default_checkpointer().inspect(path, storage_options=storage_options)


def verify(path, storage_options: Optional[Mapping[str, Any]] = None,
           progress: Optional[Callable[[int, int], None]] = None) -> VerifyReport:
    """Read every stored byte and check every checksum and the metadata's coverage."""
    return default_checkpointer().verify(path, storage_options=storage_options, progress=progress)


def stats(path, *, load: bool = False, storage_options: Optional[Mapping[str, Any]] = None) -> StatsReport:
    """Every rank's record of the save of `path` (load=True: of its last load): per-phase times
    and the stragglers, as `bytecheckpoint stats` prints them (docs/monitoring.md)."""
    return default_checkpointer().stats(path, load=load, storage_options=storage_options)


def is_checkpoint(path, storage_options: Optional[Mapping[str, Any]] = None) -> bool:
    """True only for a committed checkpoint (its metadata file exists and parses)."""
    return default_checkpointer().is_checkpoint(path, storage_options=storage_options)


def delete(path, storage_options: Optional[Mapping[str, Any]] = None) -> None:
    """Remove a checkpoint: the commit point first, so a half-deleted one never looks valid."""
    default_checkpointer().delete(path, storage_options=storage_options)


def latest(directory, *, storage_options: Optional[Mapping[str, Any]] = None) -> Optional[str]:
    """The newest committed checkpoint directly under `directory`, or None (a first launch).

    Skips torn and in-progress checkpoints (no committed metadata.json) and unreadable ones.
    Newest: the largest `step` given to save() (none counts as -1), then the latest time save()
    was called; names are not compared (step_9 / step_10 order by their recorded steps). This
    process alone (no collective): call it on every rank at start-up, before any save. Local
    directories and object-store prefixes (s3://, gs://, with `storage_options`).
    docs/elastic.md."""
    return _latest(default_checkpointer(), directory, storage_options)


def keep_last(directory, k: int, *, storage_options: Optional[Mapping[str, Any]] = None, process_group=None,
              dry_run: bool = False, remove_incomplete_older_than_s: Optional[float] = None) -> RetentionReport:
    """Delete all but the newest `k` complete checkpoints under `directory` (see catalog/retention.py)."""
    return default_checkpointer().keep_last(directory, k, storage_options=storage_options,
                                            process_group=process_group, dry_run=dry_run,
                                            remove_incomplete_older_than_s=remove_incomplete_older_than_s)
