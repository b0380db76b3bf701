"""Loading a trained model from a bytecheckpoint directory on one process (inference).

``LightningModule.load_from_checkpoint(path)`` reads its file with ``torch.load``, which cannot
read a directory. Importing ``lightning_bytecheckpoint`` routes that read through
:func:`read_checkpoint` when ``path`` is a bytecheckpoint checkpoint (anything else goes to
Lightning's own loader unchanged), so ``Model.load_from_checkpoint(dir)`` works on a checkpoint
directory as on a file: hyper-parameters, ``hparams_file``, ``strict``, ``map_location`` and
``on_load_checkpoint`` behave exactly as Lightning defines them.

:func:`load_from_checkpoint` is the explicit form of the same call.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional, Type, TypeVar

from lightning.fabric.utilities.types import _PATH

from . import _compat, _state

T = TypeVar("T")


def read_checkpoint(path: _PATH, map_location: Any = None, weights_only: Optional[bool] = None,
                    checkpointer: Any = None) -> dict:
    """The whole checkpoint as Lightning's loader returns it (no RNG is restored: loading a model
    is not resuming a run). Read by this process alone."""
    from .checkpoint_io import ByteCheckpointIO, _to_device

    io = ByteCheckpointIO(checkpointer, restore_rng=False)  # reading starts no save: nothing to tear down
    checkpoint = io.read(path, weights_only=weights_only)
    if "state_dict" not in checkpoint and isinstance(checkpoint.get(DEEPSPEED_ENGINE_KEY), dict):
        checkpoint["state_dict"] = deepspeed_state_dict(checkpoint[DEEPSPEED_ENGINE_KEY])
    return _to_device(checkpoint, map_location)


DEEPSPEED_ENGINE_KEY = "deepspeed_engine"  # what DeepSpeedStrategy saves through ByteCheckpointIO


def deepspeed_state_dict(engine: dict) -> dict:
    """The LightningModule's state dict from a DeepSpeed engine saved by DeepSpeedStrategy (the
    engine wraps the LightningModule itself): each parameter in the module's precision at save
    time (its bf16/fp16 copy where one was saved, else the fp32 master weights), and the buffers."""
    state_dict = {}
    for name, entry in engine.items():
        if not name.startswith("__") and isinstance(entry, dict) and "fp32" in entry:
            state_dict[name] = entry.get("lp", entry["fp32"])
    state_dict.update(engine.get("__module__", {}))
    return state_dict


def is_checkpoint_dir(path: Any) -> bool:
    """A bytecheckpoint checkpoint at a path Lightning's loader would otherwise open as a file."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    if not (_state.is_bcp_path(path) or _state.scheme(path) in _state.READ_ONLY_SCHEMES):
        return False
    text = os.fspath(path)
    if "://" not in text and not os.path.isdir(text):
        return False
    import bytecheckpoint as bcp

    return _state.is_ours(bcp.default_checkpointer(), text)


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: Optional[bool] = None) -> Any:
        if is_checkpoint_dir(path_or_url):
            return read_checkpoint(path_or_url, map_location=map_location, weights_only=weights_only)
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    pl_load.__wrapped__ = original  # type: ignore[attr-defined]
    return pl_load


def hook_load_from_checkpoint() -> None:
    """Idempotent; done when lightning_bytecheckpoint is imported."""
    _compat.hook_checkpoint_loader(_wrap)


def load_from_checkpoint(cls: Type[T], path: _PATH, map_location: Any = None, hparams_file: Optional[_PATH] = None,
                         strict: Optional[bool] = None, weights_only: Optional[bool] = None, **kwargs: Any) -> T:
    """``cls.load_from_checkpoint(path, ...)`` for a bytecheckpoint directory (or a .ckpt file):
    builds the LightningModule (or LightningDataModule) from the saved hyper-parameters (``kwargs``
    override them), loads its weights, and returns it on the saved device (CPU unless
    ``map_location`` says otherwise), on this process alone."""
    hook_load_from_checkpoint()
    return cls.load_from_checkpoint(path, map_location=map_location, hparams_file=hparams_file, strict=strict,
                                    weights_only=weights_only, **kwargs)
