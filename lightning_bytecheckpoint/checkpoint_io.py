"""``ByteCheckpointIO``: Lightning's ``CheckpointIO`` hooks mapped onto the bytecheckpoint API.

Everything that touches bytes lives in the engine (``bytecheckpoint``); this class only
translates Lightning's calls (paths, ``weights_only``, ``storage_options``, top-k removal,
teardown) and keeps track of its own in-flight async saves so that nothing is deleted or
overwritten while it is still being written.

Lightning calls ``save_checkpoint`` on global rank 0 only; bytecheckpoint saves are collective.
The strategy-side adapter in :mod:`lightning_bytecheckpoint.strategy` (installed automatically
when this plugin is attached to a strategy) makes every rank call it.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional

import bytecheckpoint as bcp
import torch
import torch.distributed as dist
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io.checkpoint_plugin import CheckpointIO
from lightning.pytorch.plugins.io.torch_plugin import TorchCheckpointIO
from typing_extensions import override

from . import strategy as _strategy

log = logging.getLogger(__name__)

#: Top-level key this plugin adds to every checkpoint it writes (and removes again on load).
#: Holds this rank's RNG states and the list of the checkpoint's top-level keys.
RECORD_KEY = "bytecheckpoint_lightning"
_RECORD_VERSION = 1


class ByteCheckpointIO(CheckpointIO):
    """Save Lightning checkpoints in bytecheckpoint format: a directory written by all ranks.

    ``Trainer(plugins=[ByteCheckpointIO(async_save=True)])`` is the whole setup. Checkpoints
    become directories (the ``.ckpt`` names ``ModelCheckpoint`` picks are kept), every rank
    writes its balanced share, and ``trainer.fit(ckpt_path=...)`` can resume on a different
    number of devices. Regular ``.ckpt`` files still load (through ``TorchCheckpointIO``).

    Args:
        async_save: return from ``save_checkpoint`` once the state is staged; the write, fsync
            and commit run in the background. In-flight saves are waited for before their
            path is removed, overwritten or loaded, and at ``teardown``.
        storage_options: passed to the engine on every call (endpoint, credentials, ...);
            ``trainer.save_checkpoint(..., storage_options=...)`` entries take precedence.
        restore_rng: save each rank's torch/numpy/python (and CUDA) RNG state and restore it
            when the checkpoint is loaded.
    """

    def __init__(
        self,
        async_save: bool = False,
        storage_options: Optional[dict[str, Any]] = None,
        restore_rng: bool = True,
    ) -> None:
        super().__init__()
        self.async_save = async_save
        self.storage_options = dict(storage_options) if storage_options else None
        self.restore_rng = restore_rng
        self._legacy = TorchCheckpointIO()
        self._pending: dict[str, Any] = {}  # path -> bcp.SaveHandle of this process
        # Set by the strategy-side adapter once every rank is known to call save_checkpoint.
        self._collective = False
        _strategy.install_strategy_hook()

    # ------------------------------------------------------------------ CheckpointIO hooks

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        self._require_collective_caller()
        key = _key(path)
        self._wait_for(key)  # e.g. "last.ckpt" saved again while its previous save is in flight
        self._reap()
        if "://" not in str(path):  # like TorchCheckpointIO: the folder exists when save returns
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if _is_global_zero():  # replace what TorchCheckpointIO's atomic rename would replace
            if os.path.islink(path):  # a save_last="link" link: write a new checkpoint, not into its target
                os.unlink(path)
            elif _is_file(path):  # a .ckpt file from before the switch
                self._legacy.remove_checkpoint(path)
        state = {**checkpoint, RECORD_KEY: self._record(checkpoint)}
        handle = bcp.save(
            str(path), state, async_save=self.async_save, overwrite=True,
            storage_options=self._options(storage_options),
        )
        if self.async_save:
            self._pending[key] = handle

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        self._wait_for(_key(path))
        if not self.is_bytecheckpoint(path) and _is_file(path):
            kwargs = {} if map_location is None else {"map_location": map_location}
            return self._legacy.load_checkpoint(path, weights_only=weights_only, **kwargs)
        return self.read(path, weights_only=weights_only)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        self._wait_for(_key(path))  # never delete a checkpoint that is still being written
        if os.path.islink(path):  # ModelCheckpoint(save_last="link"): drop the link, not its target
            os.unlink(path)
        elif self.is_bytecheckpoint(path) or not _is_file(path):
            if _exists(path):
                bcp.delete(str(path), storage_options=self._options())
        else:
            self._legacy.remove_checkpoint(path)
        log.debug(f"Removed checkpoint: {path}")

    @override
    def teardown(self) -> None:
        """Wait for every in-flight save of this process; re-raise the first error."""
        self._pending.clear()
        bcp.wait_pending()

    # ------------------------------------------------------------------ used by the strategy adapter

    def is_bytecheckpoint(self, path: _PATH) -> bool:
        return bcp.is_checkpoint(str(path), storage_options=self._options())

    def read(self, path: _PATH, weights_only: Optional[bool] = None) -> dict:
        """The whole checkpoint with full (unsharded) CPU tensors; restores this rank's RNG."""
        checkpoint = bcp.load_full(str(path), storage_options=self._options(), allow_pickle=weights_only is False)
        return self._restore_rng(checkpoint)

    def read_into(self, path: _PATH, state: dict, strict: bool = True, weights_only: Optional[bool] = None) -> dict:
        """Load ``state`` in place (DTensors are resharded to their current layout; a ``None``
        placeholder receives the full saved value); restores this rank's RNG; returns ``state``."""
        bcp.load(str(path), state, strict=strict, storage_options=self._options(),
                 allow_pickle=weights_only is False)
        return self._restore_rng(state)

    def saved_keys(self, path: _PATH) -> Optional[list[str]]:
        """Top-level keys of a checkpoint written by this plugin, its own record included (None
        for checkpoints written otherwise)."""
        try:
            record = bcp.load_full(str(path), keys=[RECORD_KEY], storage_options=self._options())[RECORD_KEY]
        except bcp.StateMismatchError:  # no record: not written through this plugin
            return None
        return [*record["keys"], RECORD_KEY]

    # ------------------------------------------------------------------ internals

    def _restore_rng(self, checkpoint: dict) -> dict:
        record = checkpoint.pop(RECORD_KEY, None)
        if record is not None and self.restore_rng and record.get("rng") is not None:
            _set_rng_states(_rng_from_plain(record["rng"]))
        return checkpoint

    def _record(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        rng = _rng_to_plain(_collect_rng_states(include_cuda=True)) if self.restore_rng else None
        return {"version": _RECORD_VERSION, "keys": list(checkpoint), "rng": rng}

    def _options(self, per_call: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
        if not self.storage_options and not per_call:
            return None
        return {**(self.storage_options or {}), **(per_call or {})}

    def _wait_for(self, key: str) -> None:
        handle = self._pending.pop(key, None)
        if handle is not None:
            handle.wait()

    def _reap(self) -> None:
        """Forget finished saves, surfacing their errors now rather than at teardown."""
        for key in [k for k, h in self._pending.items() if h.done()]:
            self._pending.pop(key).wait()

    def _require_collective_caller(self) -> None:
        if not self._collective and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(
                "ByteCheckpointIO saves are collective, but this strategy calls the CheckpointIO on rank 0"
                " only. Pass the plugin to the Trainer (`Trainer(plugins=[ByteCheckpointIO()])`) or the"
                " strategy (`DDPStrategy(checkpoint_io=ByteCheckpointIO())`) so that it can adapt the"
                " strategy, and do not wrap it in AsyncCheckpointIO (use `async_save=True`)."
            )

    def __getstate__(self) -> dict:  # ddp_spawn pickles the trainer; handles are process-local
        state = dict(self.__dict__)
        state["_pending"] = {}
        return state


def _key(path: _PATH) -> str:
    text = str(path)
    return text if "://" in text else os.path.abspath(text)


def _is_file(path: _PATH) -> bool:
    """A regular Lightning ``.ckpt`` file (local or fsspec URL)."""
    text = str(path)
    if "://" not in text:
        return os.path.isfile(text)
    try:
        return get_filesystem(text).isfile(text)
    except (ImportError, ValueError):  # no fsspec implementation for this scheme: not a .ckpt file
        return False


def _is_global_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _exists(path: _PATH) -> bool:
    text = str(path)
    return os.path.lexists(text) if "://" not in text else True  # remote: let the engine decide


# RNG states hold torch tensors, which the engine treats as replicated (written once). They
# differ per rank, so they travel as numpy arrays: plain values, stored per rank.
def _rng_to_plain(states: dict[str, Any]) -> dict[str, Any]:
    return {name: _map_tensors(value, lambda t: t.cpu().numpy()) for name, value in states.items()}


def _rng_from_plain(states: dict[str, Any]) -> dict[str, Any]:
    states = {name: value for name, value in states.items() if name != "torch.cuda" or _cuda_matches(value)}
    states["torch"] = torch.from_numpy(states["torch"])
    if "torch.cuda" in states:
        states["torch.cuda"] = [torch.from_numpy(s) for s in states["torch.cuda"]]
    return states


def _cuda_matches(saved: list) -> bool:
    return torch.cuda.is_available() and len(saved) == torch.cuda.device_count()


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    return value
