"""Other formats' checkpoints read as ours (docs/switching.md): one reader per format, each
mapping its geometry onto our Metadata (dcp.py: PyTorch DCP; deepspeed.py: DeepSpeed ZeRO folders) so that the one load path (resharding, zero-redundancy,
verify, inspect, load_full) serves them all. Read, never written in place."""
from __future__ import annotations

import re
from typing import Optional, Sequence

from ..common.errors import CheckpointError, IncompleteCheckpointError
from ..format.metadata import Metadata
from ..storage import Storage
from . import dcp, deepspeed

# a commit point of some format: what `latest` and retention look for beside metadata.json
COMMIT_FILES = (dcp.DCP_METADATA,)
_TRAILING_STEP = re.compile(r"(?:step|checkpoint)[-_=]?(\d+)$")


def read_metadata(store: Storage) -> Optional[Metadata]:
    """The checkpoint at `store` in a format other than ours, as our Metadata; None if none is
    recognised. Foreign formats record no training step: the folder name's trailing integer
    (torchtitan's step-N, the Trainer's checkpoint-N) stands for it, so `latest` orders them."""
    md = dcp.read_metadata(store)
    if md is None:
        md = deepspeed.read_metadata(store)
    if md is None:
        return None
    step = _TRAILING_STEP.search(store.url.rstrip("/").rsplit("/", 1)[-1])
    if step is not None and md.info.get("step") is None:
        md = _with_info(md, step=int(step.group(1)))
    return md


def fit(md: Metadata, state) -> Metadata:
    """A foreign checkpoint in the form a load's template asks for (a DeepSpeed folder loaded into
    a DeepSpeed engine: the engine's own form, deepspeed_view.py); ours unchanged."""
    if md.foreign is None:
        return md
    from . import deepspeed_view
    return deepspeed_view.fit(md, state)


def _with_info(md: Metadata, **info) -> Metadata:
    from dataclasses import replace
    return replace(md, info={**md.info, **info})


def incomplete(store: Storage, keys: Sequence[str]) -> Optional[CheckpointError]:
    """Why a foreign checkpoint is not read: a save that did not finish (data files, no commit
    point), or a format recognised but not read yet; None if nothing is recognised."""
    if any(k.endswith(".distcp") for k in keys):
        return IncompleteCheckpointError(
            f"{store.url!r} holds PyTorch DCP data (*.distcp) but no .metadata: the save that wrote it did not "
            f"finish (it crashed, or is still running). It is not loaded; use an earlier checkpoint")
    return None
