"""Agreement between processes before an attached save_state / load_state writes or reads
anything (every process arrived in time, passed the same directory), and which numbered
checkpoint folder a load resumes from. The adapter's one user of the engine's collectives."""
from __future__ import annotations

import logging
import os
import re
from typing import Any, Dict, List, Optional, Tuple

import bytecheckpoint as bcp
from bytecheckpoint.collectives.comm import Comm

from . import _routes as routes

logger = logging.getLogger(__name__)

#: Name of the bytecheckpoint directory inside each Accelerate checkpoint directory.
CHECKPOINT_SUBDIR = "bytecheckpoint"
# Files Accelerate writes for models when it handles them itself (checkpoints saved without attach).
LEGACY_MODEL_FILES = ("model.safetensors", "pytorch_model.bin")


def save_on_each_node(accelerator: Any) -> bool:
    # ProjectConfiguration.save_on_each_node exists from accelerate 0.21 (older ones save on the main process only)
    return bool(getattr(accelerator.project_configuration, "save_on_each_node", False))


def arrive(ckpt: "bcp.Checkpointer", what: str, route: routes.Route, why: str = "") -> Comm:
    """Every process must reach this point within the checkpointer's timeout_s (bounded)."""
    comm = Comm(ckpt.process_group)
    timeout = ckpt.options.timeout_s
    try:
        comm.arrive(timeout, f"accelerator.{what}")
    except bcp.PeerTimeoutError as exc:
        hint = ("; or attach without collective_save=True so that the main process saves replicated state alone"
                if what == "save_state" and not route.sharded else "")
        raise bcp.PeerTimeoutError(
            f"accelerator.{what} with {route.name} state is collective{' ' + why if why else ''}: not every process called it "
            f"within {timeout:g} s (bytecheckpoint timeout_s, env BCP_TIMEOUT_S). Call it on every process, "
            f"not only under `if accelerator.is_main_process:`{hint}. [{exc}]") from exc
    return comm

def agree(acc: Any, ckpt: "bcp.Checkpointer", what: str, route: routes.Route, directory: str,
          kept: Optional[List[int]] = None) -> Any:
    """Collective routes, before anything is written or read: every process passed the same
    directory; the models saved are the main process's choice (Accelerate writes weights
    from the main process, so its hooks decide)."""
    comm = arrive(ckpt, what, route)
    views = comm.all_gather((os.path.abspath(directory), kept, bool(acc.is_local_main_process)))
    if len({v[0] for v in views}) > 1:
        per_rank = "; ".join(f"rank {r}: {v[0]}" for r, v in enumerate(views))
        raise bcp.CheckpointError(
            f"accelerator.{what}: the processes passed different directories ({per_rank}). {route.name} "
            "state is written and read by every process in one directory: pass the same directory on every "
            "process, on a file system they all see. Nothing was written or read by bytecheckpoint.")
    nodes = sum(1 for v in views if v[2])
    if save_on_each_node(acc) and nodes > 1:
        raise bcp.CheckpointError(
            f"accelerator.{what}: save_on_each_node=True (node-local directories) with {route.name} state "
            f"on {nodes} nodes: each node would hold only its own part. Use a shared file system and "
            "save_on_each_node=False" + ("" if route.sharded else ", or attach without collective_save=True")
            + ". Nothing was written or read by bytecheckpoint.")
    return views[0][1]

def _numbered(acc: Any) -> List[Tuple[int, str]]:
    """(number, folder) of every folder under ``<project_dir>/checkpoints`` that has a number in
    its name, by Accelerate's own rule (the first number of the name: checkpoint_<n>)."""
    base = os.path.join(acc.project_dir, "checkpoints")
    if not os.path.isdir(base):
        return []
    numbered = []
    for name in os.listdir(base):
        found = re.findall(r"([0-9]+)(?=[^/]*$)", name)  # Accelerate's ordering
        if found:
            numbered.append((int(found[0]), os.path.join(base, name)))
    return numbered


def continue_naming(acc: Any) -> None:
    """With automatic naming: move ``project_configuration.iteration`` past every numbered folder
    (torn ones included), so that the next ``save_state`` names a folder that does not exist yet.
    Accelerate's ``load_state`` leaves the counter where it was, and its ``save_state`` then
    refuses ``checkpoint_<n> already exists``: every restart of a job would die on it. Never
    moves the counter back."""
    config = acc.project_configuration
    if not config.automatic_checkpoint_naming:
        return
    numbers = [n for n, _ in _numbered(acc)]
    if numbers and max(numbers) + 1 > config.iteration:
        logger.info("bytecheckpoint: automatic checkpoint naming continues at checkpoint_%d (was %d)",
                    max(numbers) + 1, config.iteration)
        config.iteration = max(numbers) + 1


def latest_committed(acc: Any, ckpt: "bcp.Checkpointer", storage: Dict[str, Any]) -> Optional[str]:
    """With automatic naming, load_state() resumes from the newest checkpoint_<n> whose
    bytecheckpoint part was committed (an async save cut short by a crash leaves Accelerate's
    files without it); Accelerate itself would pick the newest folder, committed or not."""
    if not acc.project_configuration.automatic_checkpoint_naming:
        return None
    skipped = []
    for _, folder in sorted(_numbered(acc), reverse=True):
        if _loadable(ckpt, storage, folder):
            if skipped:
                logger.warning("bytecheckpoint: skipping uncommitted checkpoint(s) %s; resuming from %s", skipped, folder)
            return folder
        skipped.append(folder)
    return None

def _loadable(ckpt: "bcp.Checkpointer", storage: Dict[str, Any], folder: str) -> bool:
    if ckpt.is_checkpoint(os.path.join(folder, CHECKPOINT_SUBDIR), **storage):
        return True
    return not os.path.isdir(os.path.join(folder, CHECKPOINT_SUBDIR)) and any(
        os.path.exists(os.path.join(folder, name)) for name in LEGACY_MODEL_FILES
    )
