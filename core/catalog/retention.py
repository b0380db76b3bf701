"""Retention: keep the newest k complete checkpoints under a directory, delete older ones.

    bcp.save(f"{run}/step-{step}", state).wait()
    bcp.keep_last(run, 3)          # on every rank (collective) or on one process
    ckpt.keep_last(run, 3)         # the same on a Checkpointer (sees its own in-flight saves)

Safety rules, in order:
- k >= 1: the newest complete checkpoint is never deleted.
- Only *complete* checkpoints (metadata.json present and valid) are ever candidates. A directory
  without metadata may be a save in progress (on any node) and is left alone, unless
  `remove_incomplete_older_than_s` is given: then an incomplete local directory older than every
  complete checkpoint we keep, and untouched for that many seconds, is removed (crash leftovers).
- A path that an in-flight async save of the Checkpointer targets is never deleted.
- A checkpoint whose metadata cannot be read is reported, not deleted.
- Deletion removes metadata.json first (bcp.delete), so a half-deleted checkpoint never looks valid.
Newest is the order of `latest` (format.metadata.order_key: the step given to save(), then when save() was
called; the save id breaks ties), so `keep_last` always keeps what `latest` would resume from.

`latest(directory)`: the newest committed checkpoint directly under `directory` (docs/elastic.md):

    path = bcp.latest("ckpts")          # None on a first launch
    if path is not None:
        bcp.load(path, state)
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from ..common.errors import CheckpointError
from ..collectives.comm import Comm
from ..foreign import COMMIT_FILES
from ..format.metadata import METADATA_FILE, order_key
from ..storage.specs import split_url


@dataclass
class RetentionReport:
    kept: List[str] = field(default_factory=list)          # complete, newest first
    deleted: List[str] = field(default_factory=list)
    incomplete: List[str] = field(default_factory=list)    # left alone (maybe in progress)
    removed_incomplete: List[str] = field(default_factory=list)
    unreadable: List[str] = field(default_factory=list)    # metadata damaged: left alone, reported
    in_flight: List[str] = field(default_factory=list)     # targets of this process's pending saves


def apply_retention(ckpt, directory, k: int, *, storage_options: Any, comm: Comm, dry_run: bool = False,
              remove_incomplete_older_than_s: Optional[float] = None) -> RetentionReport:
    """Delete all but the newest `k` complete checkpoints directly under `directory`, using the
    Checkpointer `ckpt` (its storage, its in-flight saves).

    Collective when `comm` spans several ranks: the coordinator decides and deletes, every rank
    gets the same report (or the same error)."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise CheckpointError(f"keep_last: k must be an integer >= 1 (the newest complete checkpoint is never "
                              f"deleted), got {k!r}")
    directory = os.fspath(directory)
    return comm.run_on_coordinator(
        lambda: _keep_last(ckpt, directory, k, storage_options, dry_run, remove_incomplete_older_than_s),
        f"applying retention to {directory!r}")


def _keep_last(ckpt, directory: str, k: int, storage_options, dry_run: bool, incomplete_age: Optional[float]
               ) -> RetentionReport:
    report = RetentionReport()
    children = _children(ckpt, directory, storage_options)
    pending = {_norm(p) for p in ckpt.pending_paths()}
    complete: List[Tuple[float, str, str]] = []
    for name, has_metadata in children:
        path = _join(directory, name)
        if _norm(path) in pending:
            report.in_flight.append(path)
            continue
        if not has_metadata:
            report.incomplete.append(path)
            continue
        try:
            md = ckpt.metadata(path, storage_options=storage_options)
        except CheckpointError:
            report.unreadable.append(path)
            continue
        complete.append((order_key(md.info), md.save_id, path, _created(md.info)))
    complete.sort(reverse=True)
    keep, drop = complete[:k], complete[k:]
    report.kept = [p for _, _, p, _ in keep]
    for _, _, path, _ in drop:
        if not dry_run:
            ckpt.delete(path, storage_options=storage_options)
        report.deleted.append(path)
    if incomplete_age is not None and keep and split_url(directory)[0] == "file":
        oldest_kept = min(c for _, _, _, c in keep)
        now = time.time()
        for path in list(report.incomplete):
            newest = _newest_mtime(path)
            if newest < oldest_kept and now - newest > incomplete_age:
                if not dry_run:
                    ckpt.delete(path, storage_options=storage_options)
                report.incomplete.remove(path)
                report.removed_incomplete.append(path)
    return report


def _created(info) -> float:
    """When a checkpoint was committed (what crash leftovers are compared with)."""
    created = info.get("created_unix")
    return float(created) if isinstance(created, (int, float)) else 0.0


COMMITS = (METADATA_FILE,) + COMMIT_FILES  # ours, and other formats' (core/foreign/)


def _children(ckpt, directory: str, storage_options) -> List[Tuple[str, bool]]:
    scheme = split_url(directory)[0]
    if scheme == "file":
        root = split_url(directory)[2]
        if not os.path.isdir(root):
            return []
        return sorted((n, any(os.path.isfile(os.path.join(root, n, f)) for f in COMMITS)) for n in os.listdir(root)
                      if os.path.isdir(os.path.join(root, n)) and not os.path.islink(os.path.join(root, n)))
    keys = ckpt.storage(directory, storage_options).list()
    names = {}
    for key in keys:
        if "/" not in key:
            continue
        name, rest = key.split("/", 1)
        names[name] = names.get(name, False) or rest in COMMITS
    return sorted(names.items())


def _join(directory: str, name: str) -> str:
    return directory.rstrip("/") + "/" + name


def _norm(path: str) -> str:
    scheme, bucket, rel = split_url(path)
    return f"{scheme}://{bucket}/{rel}"


def _newest_mtime(path: str) -> float:
    newest = 0.0
    for d, _, files in os.walk(split_url(path)[2]):
        for f in files:
            try:
                newest = max(newest, os.path.getmtime(os.path.join(d, f)))
            except OSError:
                pass
    return newest or os.path.getmtime(split_url(path)[2])


def newest_complete(ckpt, path: str, storage_options) -> Optional[Tuple[Tuple[int, float], str]]:
    """(order key (format.metadata.order_key), path) of `path` itself if it is a complete checkpoint, else of
    the newest complete checkpoint directly under it; None when there is none. Children without
    a metadata file (torn, or a save in progress) and children whose metadata cannot be read are
    skipped; names play no part in the order (step_9 / step_10 sort by what save() recorded)."""
    if ckpt.is_checkpoint(path, storage_options=storage_options):
        return order_key(ckpt.metadata(path, storage_options=storage_options).info), path
    best: Optional[Tuple[Tuple[int, float], str]] = None
    for name, has_metadata in _children(ckpt, path, storage_options):
        if not has_metadata:
            continue
        child = _join(path, name)
        try:
            created = order_key(ckpt.metadata(child, storage_options=storage_options).info)
        except CheckpointError:
            continue
        if best is None or created > best[0]:
            best = (created, child)
    return best


def latest(ckpt, directory, storage_options) -> Optional[str]:
    """The newest committed checkpoint directly under `directory` (or `directory` itself when it
    is one), by the order of `newest_complete`; None when there is none (or no such directory).
    This process alone: nothing collective, nothing cached between calls."""
    if not isinstance(directory, (str, os.PathLike)):
        raise CheckpointError(f"latest: directory must be a path or URL string, got {type(directory).__name__} "
                              f"{directory!r:.60}")
    found = newest_complete(ckpt, os.fspath(directory), storage_options)
    return None if found is None else found[1]
