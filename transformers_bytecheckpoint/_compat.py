"""The one place that names transformers.Trainer's private methods.

The adapter wraps these methods on the *instance* (entries in ``trainer.__dict__``; the class and
other Trainers are untouched). Each is checked when ``attach`` runs: when one is missing or takes
other arguments, ``TransformersCompatError`` names it, what the adapter needs it for, the
installed transformers version and the version the adapter is tested with.

| private method | why the adapter wraps it | why no public hook serves |
|---|---|---|
| `Trainer._save_checkpoint(model, trial)` | the checkpoint itself: the stock method runs (checkpoint folder, best-checkpoint tracking, stateful callbacks, `trainer_state.json`), then model, optimizer, scheduler, scaler and RNG are saved through bytecheckpoint, then rotation | `on_save` callbacks run after the files were written; there is no save hook |
| `Trainer._save_optimizer_and_scheduler`, `._save_scaler`, `._save_rng_state` | inside a checkpoint: write nothing, record that the stock Trainer would save this part | the parts are written by these methods directly |
| `Trainer._save(output_dir, state_dict)` | called (not wrapped) with FSDP `FULL_STATE_DICT` / DeepSpeed: writes the gathered `model.safetensors`, config and processing class as stock `save_model` does (_gathered.py) | `save_model` would also write DeepSpeed's own checkpoint |
| `Trainer._push_from_checkpoint(folder)` | with `push_to_hub`: deferred until the checkpoint is committed | called inside `_save_checkpoint` |
| `Trainer._get_output_dir(trial)` | the run directory whose `checkpoint-*` folders rotation looks at | no public getter |
| `Trainer._load_from_checkpoint(path, model=None)` | skipped for a bytecheckpoint folder (loaded after `prepare`, below); a stock FSDP `SHARDED_STATE_DICT` folder resumed without FSDP: the model from its DCP folder | resume loads are private steps of `train()` |
| `Trainer._prepare_for_training(max_steps, dl, resume)` | a bytecheckpoint folder is loaded (model, optimizer, scheduler, scaler, DeepSpeed engine) right after `accelerator.prepare`, in place | DeepSpeed resume calls a module function, not a method |
| `Trainer._load_optimizer_and_scheduler(checkpoint)` | a stock FSDP `SHARDED_STATE_DICT` folder resumed without FSDP: the optimizer from its DCP folder through the engine, the scheduler as stock | the stock method looks for `optimizer.pt` there |
| `Trainer._load_rng_state(checkpoint)` | RNG states from the checkpoint, with the stock rules for other process counts | |
| `Trainer._load_best_model()` | `load_best_model_at_end` from a bytecheckpoint folder | |
| `Trainer._finalize_training(trial, n, start)` | pending async saves committed before the best model is loaded and `save_total_limit=1` deletes | |
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Tuple

import transformers

#: transformers versions the adapter is tested with (docs/transformers.md).
TESTED = "5.18.0 to 5.24.0"

#: private method -> (parameters after self, what the adapter needs it for)
PRIVATE: Dict[str, Tuple[Tuple[str, ...], str]] = {
    "_save_checkpoint": (("model", "trial"), "saving a checkpoint"),
    "_save_optimizer_and_scheduler": (("output_dir",), "the optimizer/scheduler part of a checkpoint"),
    "_save_scaler": (("output_dir",), "the grad scaler part of a checkpoint"),
    "_save_rng_state": (("output_dir",), "the RNG part of a checkpoint"),
    "_save": (("output_dir", "state_dict"), "the gathered weights file of FSDP/DeepSpeed checkpoint folders"),
    "_push_from_checkpoint": (("checkpoint_folder",), "pushing a committed checkpoint to the Hub"),
    "_get_output_dir": (("trial",), "the run directory of the checkpoint folders"),
    "_load_from_checkpoint": (("resume_from_checkpoint", "model"), "loading model weights on resume"),
    "_prepare_for_training": (("max_steps", "train_dataloader", "resume_from_checkpoint"), "loading on resume"),
    "_load_optimizer_and_scheduler": (("checkpoint",), "a stock FSDP sharded folder resumed without FSDP; the "
                                                       "scheduler of a stock DeepSpeed folder"),
    "_load_rng_state": (("checkpoint",), "restoring RNG states on resume"),
    "_load_scaler": (("checkpoint",), "a stock DeepSpeed folder: the scaler as stock, after the engine"),
    "_load_best_model": ((), "load_best_model_at_end"),
    "_finalize_training": (("trial", "num_train_samples", "start_time"), "the end of train()"),
}
#: public methods wrapped the same way (checked too: a changed signature would break the wrapper)
PUBLIC: Dict[str, Tuple[Tuple[str, ...], str]] = {
    "train": (("resume_from_checkpoint", "trial", "ignore_keys_for_eval"), "resume_from_checkpoint=True"),
    "save_model": (("output_dir", "_internal_call"), "the model files of a checkpoint"),
}


class TransformersCompatError(RuntimeError):
    """A Trainer method the adapter wraps is missing or takes other arguments."""


def version() -> str:
    return getattr(transformers, "__version__", "unknown")


def _error(name: str, purpose: str, found: str) -> TransformersCompatError:
    return TransformersCompatError(
        f"transformers_bytecheckpoint needs Trainer.{name} ({purpose}); in transformers {version()} it {found}. "
        f"The adapter is tested with transformers {TESTED}: install that version, or update "
        "transformers_bytecheckpoint/_compat.py for this one.")


def check(trainer: Any) -> None:
    """Fail at attach time, not in the middle of a save, if a wrapped method changed."""
    for table in (PRIVATE, PUBLIC):
        for name, (params, purpose) in table.items():
            method = getattr(type(trainer), name, None)
            if not callable(method):
                raise _error(name, purpose, "is missing")
            got = tuple(p for p in inspect.signature(method).parameters if p != "self")
            if got[:len(params)] != params:
                raise _error(name, purpose, f"takes {got}, not {params}")


def method(trainer: Any, name: str) -> Callable:
    """The bound method as the instance has it now (the class's, or an earlier instance patch)."""
    if name not in PRIVATE and name not in PUBLIC:
        raise KeyError(f"{name} is not a method the adapter declares in _compat.py")
    return getattr(trainer, name)


def output_dir(trainer: Any, trial: Any) -> str:
    return trainer._get_output_dir(trial=trial)


def jit_managers(trainer: Any) -> list:
    """The JIT checkpoint managers (`enable_jit_checkpoint=True`): public names of
    transformers.trainer_jit_checkpoint (`JITCheckpointCallback.jit_manager`,
    `CheckpointManager.execute_jit_checkpoint`)."""
    found = []
    for cb in trainer.callback_handler.callbacks:
        manager = getattr(cb, "jit_manager", None)
        if type(cb).__name__ == "JITCheckpointCallback" and manager is not None:
            if not callable(getattr(manager, "execute_jit_checkpoint", None)):
                raise _error("callback_handler JITCheckpointCallback.jit_manager.execute_jit_checkpoint",
                             "checkpoints on SIGTERM", "is missing")
            found.append(manager)
    return found
