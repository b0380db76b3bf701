"""The one place that touches Accelerate's private attributes.

Every access is checked: when an attribute is gone or has changed type, the error names it, what
the adapter needs it for, the installed Accelerate version and the versions it was tested with.

| private attribute | used for | why no public API serves |
|---|---|---|
| `Accelerator._optimizers` | the prepared optimizers; swapped for an empty list while `save_state` / `load_state` run, so Accelerate writes/reads no `optimizer.bin` | the pre-hooks receive models but not optimizers, and `save_state` binds the list before the hooks run; there is no public getter |
| `Accelerator._schedulers`, `._custom_objects` | read by the local-tier `save_local` / `restore` only: the schedulers and registered objects Accelerate's `save_state` writes to its own files | no public getter lists them |
| `Accelerator._models` | FSDP only: swapped for an empty list so Accelerate does not save/load the models through DCP, and read to know them on load | for FSDP `save_state`/`load_state` handle models *before* any hook; the load hook receives an empty list |
| `Accelerator._dataloaders` | the prepared loaders: their global order is adopted at attach (loaders prepared before it) and recorded in every checkpoint (`_data.py`) | no public getter lists them |
| `Accelerator._save_model_state_pre_hook`, `._load_model_state_pre_hook` | ordering: the adapter's first hook runs before every user hook (it snapshots `weights`), its last hook after them (it takes what they left) | hooks run in registration order and there is no public way to order them |

Everything else the adapter uses is public: `register_save_state_pre_hook`,
`register_load_state_pre_hook`, `prepare_data_loader` (wrapped on the instance), `DataLoaderShard.set_sampler`
/ `set_epoch` / `total_batch_size`, `unwrap_model`, `distributed_type`, `is_main_process`,
`is_local_main_process`, `project_configuration`, `project_dir`, `step`, `AcceleratedOptimizer.optimizer`.
"""
from __future__ import annotations

import inspect
from collections import OrderedDict
from typing import Any

import accelerate

#: Accelerate versions the adapter is tested with (docs/accelerate.md, "Accelerate versions").
TESTED = "1.6.0 to 1.15.0"

_HOOK_DICTS = {"save": "_save_model_state_pre_hook", "load": "_load_model_state_pre_hook"}
_NEEDED = {
    "_optimizers": (list, "the prepared optimizers"),
    "_models": (list, "the prepared models"),
    "_schedulers": (list, "the prepared LR schedulers (local-tier saves)"),
    "_custom_objects": (list, "the objects passed to register_for_checkpointing (local-tier saves)"),
    "_dataloaders": (list, "the prepared dataloaders (their data order is saved)"),
    "_save_model_state_pre_hook": (OrderedDict, "the order of save_state pre-hooks"),
    "_load_model_state_pre_hook": (OrderedDict, "the order of load_state pre-hooks"),
}


class AccelerateCompatError(RuntimeError):
    """A private Accelerate attribute the adapter needs is missing or changed."""


def version() -> str:
    return getattr(accelerate, "__version__", "unknown")


def _get(accelerator: Any, name: str) -> Any:
    typ, purpose = _NEEDED[name]
    value = getattr(accelerator, name, None)
    if not isinstance(value, typ):
        found = "missing" if value is None else f"a {type(value).__name__}, not a {typ.__name__}"
        raise AccelerateCompatError(
            f"accelerate_bytecheckpoint needs Accelerator.{name} ({purpose}); in accelerate {version()} it is "
            f"{found}. The adapter is tested with accelerate {TESTED}: install one of those, or update "
            "accelerate_bytecheckpoint/_compat.py for this version."
        )
    return value


def check(accelerator: Any) -> None:
    """Fail at attach time, not in the middle of a save, if a needed attribute is gone."""
    for name in _NEEDED:
        _get(accelerator, name)


def models(accelerator: Any) -> list:
    return _get(accelerator, "_models")


def optimizers(accelerator: Any) -> list:
    return _get(accelerator, "_optimizers")


def schedulers(accelerator: Any) -> list:
    return list(_get(accelerator, "_schedulers"))


def custom_objects(accelerator: Any) -> list:
    return list(_get(accelerator, "_custom_objects"))


def dataloaders(accelerator: Any) -> list:
    return list(_get(accelerator, "_dataloaders"))


def set_lists(accelerator: Any, models_: list, optimizers_: list) -> None:
    """Replace the models / optimizers lists (the objects Accelerate reads at its next step)."""
    _get(accelerator, "_models")
    _get(accelerator, "_optimizers")
    accelerator._models = models_
    accelerator._optimizers = optimizers_


def move_hook(accelerator: Any, kind: str, handle: Any, *, first: bool) -> None:
    """Put the hook behind `handle` (from register_{save,load}_state_pre_hook) first or last."""
    hooks = _get(accelerator, _HOOK_DICTS[kind])
    hook_id = getattr(handle, "id", None)
    if hook_id not in hooks:
        raise AccelerateCompatError(
            f"accelerate_bytecheckpoint: its {kind}_state pre-hook is no longer registered in "
            f"Accelerator.{_HOOK_DICTS[kind]} (accelerate {version()}); was it removed by hand? Call remove() on "
            "the attachment and attach again."
        )
    hooks.move_to_end(hook_id, last=not first)


def unwrap(accelerator: Any, model: Any) -> Any:
    """`accelerator.unwrap_model` stripping DDP and torch.compile but keeping the fp32 output
    wrapper; `keep_torch_compile` exists from accelerate 1.2 (older versions always strip it)."""
    if "keep_torch_compile" in inspect.signature(accelerator.unwrap_model).parameters:
        return accelerator.unwrap_model(model, keep_fp32_wrapper=True, keep_torch_compile=False)
    return accelerator.unwrap_model(model, keep_fp32_wrapper=True)


class _Bound:
    """``accelerator.<name>`` as the class defines it, bound at each call. Unlike a bound method it
    pickles (an attached Accelerator is picklable): Accelerate's ``@on_main_process`` methods
    (``log``) are functions named ``_inner``, and a bound method pickles by its function's name."""

    def __init__(self, accelerator: Any, name: str) -> None:
        self.accelerator, self.name = accelerator, name
        self.__name__, self.__doc__ = name, getattr(type(accelerator), name).__doc__  # for functools.wraps

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(type(self.accelerator), self.name)(self.accelerator, *args, **kwargs)


def method(accelerator: Any, name: str) -> Any:
    """What the instance's ``name`` is now, for a wrapper: an earlier instance patch, else the class's."""
    return accelerator.__dict__[name] if name in accelerator.__dict__ else _Bound(accelerator, name)
