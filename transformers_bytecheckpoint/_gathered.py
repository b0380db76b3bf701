"""The weights file the stock Trainer gathers into a checkpoint folder whose processes hold shards.

The stock ``save_model`` writes ``model.safetensors`` (a PEFT model: its adapter's files) into the
folder with FSDP ``FULL_STATE_DICT``, DeepSpeed ZeRO-1/2, and ZeRO-3 with
``stage3_gather_16bit_weights_on_model_save`` (ZeRO-3 with PEFT: the trainable weights, always),
from a gathered state dict. The adapter does the same: the state dict obtained as ``save_model``
obtains it (collectives, called on every process), written by the Trainer's own ``_save`` (weights,
config, processing class, ``training_args.bin``). It runs inside ``_save_checkpoint``, synchronously
on the training thread as in the stock Trainer, so before the bytecheckpoint commit point: a
committed folder has its weights file. DeepSpeed's own ``save_checkpoint`` never runs: ZeRO-3
without the flag gets the stock folder's config files and no weights file (the stock folder then
has DeepSpeed's checkpoint only, which ``from_pretrained`` does not open).
"""
from __future__ import annotations

import inspect
import sys
from typing import Any, Optional, Tuple

from . import _compat as compat
from . import _routes as routes


def save(trainer: Any, route: routes.Route, output_dir: str) -> bool:
    """Write the folder's model files as stock ``save_model`` does where it gathers; False where it
    does not (the caller writes the model files without weights). Call on every process."""
    found = _state_dict(trainer, route)
    if found is None:
        return False
    state_dict, weights = found
    compat.method(trainer, "_save")(output_dir, state_dict=state_dict)  # only args.should_save processes write
    if not weights:  # stock's ZeRO-3 fallback, less DeepSpeed's checkpoint: the empty (or a stale) file goes
        from transformers.trainer_pt_utils import remove_dummy_checkpoint
        from transformers.utils import SAFE_WEIGHTS_NAME, WEIGHTS_NAME

        remove_dummy_checkpoint(trainer.args.should_save, output_dir, [WEIGHTS_NAME, SAFE_WEIGHTS_NAME])
    return True


def _state_dict(trainer: Any, route: routes.Route) -> Optional[Tuple[dict, bool]]:
    """(what stock ``save_model`` passes to ``_save``, whether it keeps the weights file) in its
    branches that gather (transformers 5.18-5.24); None elsewhere."""
    if route is routes.SHARDED:
        if not getattr(trainer, "is_fsdp_enabled", False):
            return None  # DTensor parameters of tensor parallel loading: not a gathering branch of save_model
        if "FULL_STATE_DICT" not in str(trainer.accelerator.state.fsdp_plugin.state_dict_type):
            return None  # SHARDED_STATE_DICT: the stock folder has no model.safetensors
        return trainer.accelerator.get_state_dict(trainer.model), True
    if route is routes.DEEPSPEED:
        engine = trainer.deepspeed
        zero3 = engine.config.get("zero_optimization", {}).get("stage", None) == 3
        takes_exclude = "exclude_frozen_parameters" in inspect.signature(engine.save_checkpoint).parameters
        if takes_exclude and zero3 and _is_peft(trainer.model):
            return engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True), True
        try:
            return trainer.accelerator.get_state_dict(engine), True
        except ValueError:  # ZeRO-3 without stage3_gather_16bit_weights_on_model_save
            return {}, False
    return None


def _is_peft(model: Any) -> bool:
    if "peft" not in sys.modules:
        return False  # a PeftModel exists only once peft was imported
    from peft import PeftMixedModel, PeftModel

    return isinstance(model, (PeftModel, PeftMixedModel))
