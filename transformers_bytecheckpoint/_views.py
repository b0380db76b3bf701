"""The weights file of a checkpoint folder, as the stock Trainer's folder has it, written once.

The stock folder holds ``model.safetensors`` (``from_pretrained(folder)`` opens it) or, for a PEFT
model, ``adapter_model.safetensors`` (``PeftModel.from_pretrained(base, folder)``). The adapter asks
bytecheckpoint to write those tensors as safetensors packs (``save(..., safetensors=[...])``, format
6: a pack *is* the safetensors file ``save_file`` would write) and, before the commit point, hard
links the pack into the folder under the stock name: the bytes are on disk once, the folder opens
with the Hugging Face loaders, and ``metadata.json`` is written after the link (a committed
checkpoint's folder has its weights file). Deleting the folder deletes both names.

Where: the REPLICATED route (one process, DDP), whose writing process holds every tensor whole.
On sharded routes (FSDP, DeepSpeed) the stock Trainer's gathered file, where it writes one, is
written by its own ``_save`` (_gathered.py); here it is only made durable before the commit point.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict

from bytecheckpoint.storage.posix import fsync_path  # a file the Trainer did not write: nothing to keep
from bytecheckpoint.tools.safetensors import SINGLE_FILE, link_views

from . import _folders as folders
from . import _peft as peft
from . import _routes as routes

logger = logging.getLogger(__name__)


def save_kwargs(state: Dict[str, Any], route: Any, checkpoint_dir: str, output_dir: str, should_save: bool
                ) -> Dict[str, Any]:
    """`safetensors=` (REPLICATED route) and `before_commit=` for Checkpointer.save of `state`. Before
    the commit point, on the coordinator (the writing process): the Trainer's trainer_state.json, a
    gathered weights file and the folder are made durable (an async save does it in the background,
    not in the stall), and the weights file is linked."""
    targets = {}
    if route is routes.REPLICATED and peft.KEY in state:
        targets = {f"{peft.KEY}/{name}": (peft.folder_of(output_dir, name), peft.WEIGHTS_NAME)
                   for name in state[peft.KEY]}
    elif route is routes.REPLICATED and "model" in state:
        targets = {"model": (output_dir, SINGLE_FILE)}

    def before_commit(md: Any) -> None:
        if should_save:  # the Trainer's file a resume reads (its folder entry: with the folder below)
            fsync_path(os.path.join(output_dir, folders.TRAINER_STATE))
        synced = set()  # link_views fsyncs the folder it links into
        for group, (folder, name) in targets.items():
            if group not in md.safetensors:
                logger.warning("bytecheckpoint: %s has no %s: some of its tensors are not ones a safetensors file "
                               "holds (dtype), so it opens with bytecheckpoint only", folder, name)
                continue
            link_views(checkpoint_dir, md, group, folder, weights_name=name)
            synced.add(folder)
        if should_save and route is not routes.REPLICATED:  # a weights file _gathered.py had the Trainer write
            for name in os.listdir(output_dir):
                if name.endswith((".safetensors", ".safetensors.index.json")):
                    fsync_path(os.path.join(output_dir, name))
        if should_save and output_dir not in synced:
            fsync_path(output_dir)
    return {"safetensors": list(targets), "before_commit": before_commit}

