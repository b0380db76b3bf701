"""The Trainer's `checkpoint-<step>` folders: which are committed, which one a resume picks, and
`save_total_limit` rotation that never deletes the newest committed one nor one being written.

A folder written with the adapter holds `bytecheckpoint/` (model, optimizer, scheduler, scaler,
RNG; its `metadata.json` is the commit point, written after everything else) beside the
Trainer's own `trainer_state.json`, `config.json`, `training_args.bin`. It is committed when
`bytecheckpoint/` is a committed checkpoint. A folder the stock Trainer wrote (no
`bytecheckpoint/`) counts as committed when it has its `trainer_state.json` (written after the
model and optimizer files) and no JIT "in progress" sentinel.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

import bytecheckpoint as bcp

logger = logging.getLogger(__name__)

#: the bytecheckpoint checkpoint inside each `checkpoint-<step>` folder
CHECKPOINT_SUBDIR = "bytecheckpoint"
TRAINER_STATE = "trainer_state.json"
JIT_SENTINEL = "checkpoint-is-incomplete.txt"  # transformers.trainer_jit_checkpoint's marker
_NUMBERED = re.compile(r"^checkpoint-(\d+)$")  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR


def subdir(folder: str) -> str:
    return os.path.join(os.fspath(folder), CHECKPOINT_SUBDIR)


def is_ours(folder: str) -> bool:
    """The folder was written with the adapter (committed or not)."""
    return os.path.isdir(subdir(folder))


def committed(ckpt: "bcp.Checkpointer", folder: str, storage: Dict[str, Any]) -> bool:
    if is_ours(folder):
        return ckpt.is_checkpoint(subdir(folder), **storage)
    return (os.path.isfile(os.path.join(folder, TRAINER_STATE))
            and not os.path.exists(os.path.join(folder, JIT_SENTINEL)))


def numbered(run_dir: str) -> List[str]:
    """`checkpoint-<step>` folders under run_dir, newest step first."""
    if not os.path.isdir(run_dir):
        return []
    found = [(int(m.group(1)), os.path.join(run_dir, n)) for n in os.listdir(run_dir)
             if (m := _NUMBERED.match(n)) and os.path.isdir(os.path.join(run_dir, n))]
    return [path for _, path in sorted(found, reverse=True)]


def newest_committed(ckpt: "bcp.Checkpointer", run_dir: str, storage: Dict[str, Any]) -> Optional[str]:
    """What `resume_from_checkpoint=True` resumes: the newest committed folder (the stock Trainer
    takes the newest folder, committed or not); torn newer ones are skipped with a log line."""
    skipped = []
    for folder in numbered(run_dir):
        if committed(ckpt, folder, storage):
            if skipped:
                logger.warning("bytecheckpoint: skipping checkpoint folder(s) never committed (a save cut short): "
                               "%s; resuming from %s", ", ".join(skipped), folder)
            return folder
        skipped.append(folder)
    if skipped:
        logger.warning("bytecheckpoint: no committed checkpoint under %s; never committed: %s", run_dir,
                       ", ".join(skipped))
    return None


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def rotate(ckpt: "bcp.Checkpointer", run_dir: str, limit: Optional[int], best: Optional[str],
           storage: Dict[str, Any]) -> List[str]:
    """`save_total_limit` as the stock `rotate_checkpoints` applies it (oldest first by mtime, the
    newest folder and the best one kept), and also never a folder an async save of this process
    is still writing, nor the newest committed folder. Returns the deleted folders."""
    from transformers.trainer_utils import sort_checkpoints

    if limit is None or limit <= 0:
        return []
    folders = sort_checkpoints(run_dir, use_mtime=True)
    if len(folders) <= limit:
        return []
    protected = {folders[-1]}
    if best is not None:
        protected.add(str(Path(best)))
    pending = ckpt.pending_paths()
    protected.update(f for f in folders if any(_inside(p, f) for p in pending))
    newest = newest_committed_quiet(ckpt, folders, storage)
    if newest is not None:
        protected.add(newest)
    keep = max(limit, len(protected))
    remaining, deleted = len(folders), []
    for folder in folders:
        if remaining <= keep:
            break
        if folder in protected:
            continue
        delete(ckpt, folder, storage)
        deleted.append(folder)
        remaining -= 1
    return deleted


def newest_committed_quiet(ckpt: "bcp.Checkpointer", folders: Iterable[str], storage: Dict[str, Any]) -> Optional[str]:
    steps = [(int(m.group(1)), f) for f in folders if (m := _NUMBERED.match(os.path.basename(f)))]
    for _, folder in sorted(steps, reverse=True):
        if committed(ckpt, folder, storage):
            return folder
    return None


def delete(ckpt: "bcp.Checkpointer", folder: str, storage: Dict[str, Any]) -> None:
    """The bytecheckpoint part first (its commit point first: a half-deleted folder never looks
    committed), then the folder, as the stock rotation does (shutil.rmtree)."""
    logger.info(f"Deleting older checkpoint [{folder}] due to args.save_total_limit")
    if ckpt.is_checkpoint(subdir(folder), **storage):
        ckpt.delete(subdir(folder), **storage)
    shutil.rmtree(folder, ignore_errors=True)
