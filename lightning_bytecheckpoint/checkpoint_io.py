"""``ByteCheckpointIO``: Lightning's ``CheckpointIO`` hooks mapped onto one ``bcp.Checkpointer``.

Calling contract (docs/lightning.md has the table per strategy):

* Lightning's own strategies call ``save_checkpoint`` on one rank (global rank 0; local rank 0
  for ``ddp_spawn``'s final weights). A checkpoint that rank holds whole (replicated DDP state,
  single device, FSDP's "full" state) is saved by that rank alone (``process_group=bcp.LOCAL``):
  nothing waits for another rank, so nothing can hang.
* A checkpoint that holds sharded values (DTensor shards, ShardedTensor) needs every holder. The
  strategy adapters (strategies.py) make every rank call the engine for those; reached any other
  way, such a save fails at once, naming the key and the fix.
* Loads read with ``bcp.LOCAL`` too: each rank reads what it needs, like ``torch.load`` on every
  rank. With a Trainer that runs on one device or DDP, the model's weights are read straight
  into the module's tensors (Lightning then finds them already in place).

Paths: local paths, ``file://``, ``s3://`` and ``gs://`` are bytecheckpoint checkpoints
(directories or prefixes). Other fsspec URLs (``memory://``, ``hdfs://``, ...) are file systems
bytecheckpoint does not write; their checkpoints go through Lightning's ``TorchCheckpointIO``
as regular files (with a warning once per scheme), so Lightning's fsspec-based lookups keep
working. A bytecheckpoint directory served over http(s) is loaded by the engine (read-only).
"""
from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Callable, Dict, Mapping, Optional

import bytecheckpoint as bcp
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io.checkpoint_plugin import CheckpointIO
from lightning.pytorch.plugins.io.torch_plugin import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from . import _compat, _metrics, _state, _stock

log = logging.getLogger(__name__)

#: Top-level key this plugin adds to every checkpoint it writes (and removes again on load).
#: Holds the saving rank's RNG states and the list of the checkpoint's top-level keys.
RECORD_KEY = "bytecheckpoint_lightning"
_RECORD_VERSION = 2


class ByteCheckpointIO(CheckpointIO):
    """Save Lightning checkpoints in bytecheckpoint format: a directory that loads into any layout.

    ``Trainer(plugins=[ByteCheckpointIO(async_save=True)])`` is the whole setup; ``Fabric(plugins=
    [ByteCheckpointIO()])`` works the same way. Checkpoints become directories (the ``.ckpt``
    names ``ModelCheckpoint`` picks are kept) and resume on another device count or strategy.
    Regular ``.ckpt`` files still load (through ``TorchCheckpointIO``).

    Args:
        checkpointer: a ``bcp.Checkpointer`` to use. It is shared: the plugin waits for its saves
            at teardown but never closes it. ``None``: the default engine behind ``bcp.save``
            (BCP_* environment variables supply its defaults); an idle engine holds no thread.
        async_save: return from a save once the state is staged; writing and commit run in the
            background. ``None``: the checkpointer's setting.
        async_staging: with async_save, the optimizers' tensors are copied behind the next forward and
            backward, and the optimizer step waits for them (docs/async_staging.md). ``None``: the
            checkpointer's setting ("auto": on for GPU tensors). The staging buffers are allocated by
            themselves after the first optimizer step (warm_up.py), not in the first save.
        storage_options: engine storage options (endpoint, credentials, ...) for every call;
            ``trainer.save_checkpoint(..., storage_options=...)`` entries take precedence.
        restore_rng: save the saving rank's torch/numpy/python (and CUDA) RNG states and restore
            them on load.
        log_metrics: log ``checkpoint/...`` metrics (stall, save and load seconds, bytes,
            throughput) to the Trainer's loggers, with the Trainer's next log step (its
            ``log_every_n_steps`` and step; docs/monitoring.md). ``None``: on, unless ``BCP_LOG_METRICS=0``.
        data_order: save the train loader's position with every checkpoint and resume it on any
            device count, step for step (docs/data.md). On one device the loader then draws
            DistributedSampler's order instead of the global RNG's. ``data_order_report`` holds
            the line a resume printed (``data order: exact (...)`` or the reason it is not).
    """

    def __init__(self, checkpointer: Optional[bcp.Checkpointer] = None, *, async_save: Optional[bool] = None,
                 storage_options: Optional[Mapping[str, Any]] = None, restore_rng: bool = True,
                 log_metrics: Optional[bool] = None, data_order: bool = True,
                 async_staging: Optional[bool] = None) -> None:
        super().__init__()
        if checkpointer is not None and not isinstance(checkpointer, bcp.Checkpointer):
            raise TypeError(f"ByteCheckpointIO(checkpointer=...) takes a bytecheckpoint.Checkpointer, got "
                            f"{type(checkpointer).__name__}; pass options by name, e.g. ByteCheckpointIO(async_save=True)")
        self._checkpointer = checkpointer
        self._owned: Optional[bcp.Checkpointer] = None
        self.async_save = async_save
        self.async_staging = async_staging
        self.storage_options = _check_options(storage_options, "storage_options")
        self.restore_rng = restore_rng
        self._legacy = TorchCheckpointIO()
        self._warned_schemes: set = set()
        self._strategy_ref: Optional[weakref.ref] = None  # set by connect()
        self._template_for: Optional[Callable[["ByteCheckpointIO", _PATH], Optional[Dict[str, Any]]]] = None
        self._metrics = _metrics.MetricsLog(log_metrics)
        self.data_order = data_order
        self.data_order_report: Optional[str] = None  # set by data.py when a resume hands the position over

    # ------------------------------------------------------------------ the engine

    @property
    def checkpointer(self) -> bcp.Checkpointer:
        """The ``bcp.Checkpointer`` every call of this plugin goes through: the one passed in, or
        (``checkpointer=None``) the default engine behind ``bcp.save`` (options from BCP_*)."""
        if self._checkpointer is not None:
            return self._checkpointer
        if self._owned is not None and not self._owned.closed:  # a passed one, rebuilt after pickling
            return self._owned
        return bcp.default_checkpointer()

    # ------------------------------------------------------------------ CheckpointIO hooks

    @override
    def save_checkpoint(self, checkpoint: Dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        """Save ``checkpoint`` from this process alone (Lightning calls this on one rank)."""
        if not _state.is_bcp_path(path):
            self._fallback_warning(path, "saved")
            return self._legacy.save_checkpoint(checkpoint, path, storage_options=storage_options)
        options = self._options(storage_options)
        sharded = _state.find_sharded(checkpoint)
        if sharded is not None:
            raise RuntimeError(
                f"ByteCheckpointIO.save_checkpoint was called on one rank with sharded state ({sharded!r} holds only "
                f"this rank's part), so the other parts would be missing. Sharded checkpoints are written by every rank "
                f"together: use a strategy the plugin adapts (FSDPStrategy, ModelParallelStrategy; see "
                f"docs/lightning.md), or save through bcp.Checkpointer.save on every rank.")
        self.save(checkpoint, path, options, process_group=bcp.LOCAL)

    @override
    def load_checkpoint(self, path: _PATH, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        if _state.is_resume_path(path):
            return _to_device(self.restore(_state.persistent_of(path), weights_only=weights_only), map_location)
        if not _state.is_bcp_path(path):
            if is_http_checkpoint(path):  # a checkpoint directory behind a web server: read-only
                return _to_device(self.read(path, weights_only=weights_only), map_location)
            self._fallback_warning(path, "loaded")
            return _compat.legacy_load(self._legacy, path, map_location, weights_only)
        if _is_file(path):  # a regular Lightning .ckpt file (users switching mid-run)
            return _compat.legacy_load(self._legacy, path, map_location, weights_only)
        if _stock.is_sharded_dir(path):  # Lightning's own sharded directory (DCP + meta.pt): any strategy
            return _to_device(_stock.read(self.checkpointer, path, weights_only), map_location)
        if _stock.is_deepspeed_dir(path):  # DeepSpeedStrategy's stock directory, on a strategy without DeepSpeed
            return _to_device(_stock.read_deepspeed(self.checkpointer, path, weights_only), map_location)
        self._wait_for(path)
        template = self._template_for(self, path) if self._template_for is not None else None
        if template is not None:
            checkpoint = self.load(path, template, weights_only=weights_only, process_group=bcp.LOCAL)
        else:
            checkpoint = self.read(path, weights_only=weights_only)
        return _to_device(checkpoint, map_location)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        if not _state.is_bcp_path(path):
            return self._legacy.remove_checkpoint(path)
        if "://" not in str(path) and os.path.islink(path):  # save_last="link": the link, not its target
            os.unlink(path)
        elif _is_file(path):
            self._legacy.remove_checkpoint(path)
        elif "://" in str(path) or os.path.lexists(path):
            self.checkpointer.delete(str(path), **self._call_kwargs(self._options()))  # waits for its save first
        log.debug(f"Removed checkpoint: {path}")

    @override
    def teardown(self) -> None:
        """Wait for every pending save of the checkpointer (re-raise the first failure). A
        checkpointer the plugin built is closed (its threads and staging memory freed); the next
        call builds a new one. A checkpointer passed in is left open."""
        if self._checkpointer is not None:
            self._checkpointer.wait()
        elif self._owned is not None:
            owned, self._owned = self._owned, None
            owned.close()
        else:
            bcp.wait_pending()  # the default engine holds no thread once its saves are done
        self._metrics.flush(self)

    # ------------------------------------------------------------------ used by the strategy adapters

    def save(self, checkpoint: Dict[str, Any], path: _PATH, options: Optional[Dict[str, Any]] = None,
             process_group: Any = None) -> bcp.SaveHandle:
        """Save from the ranks of ``process_group`` (``bcp.LOCAL``: this process alone). A Trainer
        checkpoint's ``global_step`` is recorded as the checkpoint's step."""
        self._wait_for(path)
        if process_group is bcp.LOCAL or _is_global_zero():
            _replace_link_or_file(path, self._legacy)
        if "://" not in str(path):  # like TorchCheckpointIO: the folder exists when save returns
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        state = {**checkpoint, RECORD_KEY: self._record(checkpoint)}
        kwargs = self._call_kwargs(options)
        if self.async_save is not None:
            kwargs["async_save"] = self.async_save
        if self.async_staging is not None:
            kwargs["async_staging"] = self.async_staging
        strategy = self.strategy
        if strategy is not None and getattr(strategy, "optimizers", None):
            kwargs["optimizers"] = list(strategy.optimizers)  # the checkpoint holds their state dicts only
        step = checkpoint.get("global_step")
        if isinstance(step, int) and not isinstance(step, bool):
            kwargs["step"] = step  # bcp.latest(dirpath) orders by it (docs/elastic.md)
        if self._checkpointer is None and self._owned is None:  # the default engine, through bytecheckpoint.save
            handle = bcp.save(str(path), state, overwrite=True, process_group=process_group, **kwargs)
        else:
            handle = self.checkpointer.save(str(path), state, overwrite=True, process_group=process_group, **kwargs)
        self._metrics.saved(self, handle, kwargs.get("step"))
        return handle

    def load(self, path: _PATH, template: Dict[str, Any], *, strict: bool = True, weights_only: Optional[bool] = None,
             process_group: Any = None) -> Dict[str, Any]:
        """Load ``template`` in place (tensors keep their current layout; a ``None`` placeholder
        receives the saved value whole); restores RNG; returns ``template``."""
        self._wait_for(path)
        self.checkpointer.load(str(path), template, strict=strict, allow_pickle=weights_only is False,
                               process_group=process_group, **self._call_kwargs(self._options()))
        self._metrics.loaded(self, self.checkpointer.last_load_stats, template)
        return self._restore_rng(template)

    def save_local(self, checkpoint: Dict[str, Any], step: int, async_save: bool = True) -> bcp.SaveHandle:
        """Save ``checkpoint`` as step ``step`` of the checkpointer's local tier (every rank calls)."""
        state = {**checkpoint, RECORD_KEY: self._record(checkpoint)}
        return self.checkpointer.save(f"step_{step}", state, tier="local", step=step, async_save=async_save)

    def restore(self, persistent: Optional[str], weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """The whole checkpoint of the newest complete one of the local tier and ``persistent``
        (every rank calls; see ``resume_path``); restores RNG."""
        if self.checkpointer.local_tier is None and persistent is None:
            raise ValueError("resume_path() without a persistent directory needs a checkpointer with a local tier")
        kwargs = {"persistent": persistent, **self._call_kwargs(self._options())} if persistent else {}
        restored = self.checkpointer.restore(allow_pickle=weights_only is False, **kwargs)
        if restored.source is None:
            raise FileNotFoundError(f"ByteCheckpointIO: nothing to resume from: {restored.reason}")
        rank_zero_info(f"ByteCheckpointIO: resuming from the {restored.source} checkpoint {restored.name}"
                       + (f" ({restored.reason})" if restored.reason else ""))
        self._metrics.loaded(self, self.checkpointer.last_load_stats, restored.state)
        return self._restore_rng(restored.state)

    def read(self, path: _PATH, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """The whole checkpoint with full CPU tensors, read by this process alone; restores RNG."""
        self._wait_for(path)
        checkpoint = self.checkpointer.load_full(str(path), allow_pickle=weights_only is False,
                                                 process_group=bcp.LOCAL, **self._call_kwargs(self._options()))
        self._metrics.loaded(self, self.checkpointer.last_load_stats, checkpoint)
        return self._restore_rng(checkpoint)

    def is_bytecheckpoint(self, path: _PATH) -> bool:
        return _state.is_bcp_path(path) and _state.is_ours(self.checkpointer, path,
                                                           **self._call_kwargs(self._options()))

    def saved_keys(self, path: _PATH) -> list:
        """Top-level keys of a checkpoint (this plugin's record included)."""
        structure = self.checkpointer.metadata(str(path), **self._call_kwargs(self._options())).structure
        return [k for k, _ in structure.get("dict", [])] if isinstance(structure, dict) else []

    def connect(self, strategy: Any, template_for: Callable[["ByteCheckpointIO", _PATH], Optional[Dict[str, Any]]]) -> None:
        """Called by the strategy adapters when a strategy takes this plugin: the strategy, and how
        to build an in-place load template for it (None from it: read the checkpoint whole)."""
        self._strategy_ref = weakref.ref(strategy)
        self._template_for = template_for

    @property
    def strategy(self) -> Any:
        """The strategy this plugin was given to (None before, or after the strategy is gone)."""
        return self._strategy_ref() if self._strategy_ref is not None else None

    # ------------------------------------------------------------------ internals

    def _options(self, per_call: Any = None) -> Optional[Dict[str, Any]]:
        per_call = _check_options(per_call, "storage_options")
        if not self.storage_options and not per_call:
            return None
        base = dict(self._checkpointer.storage_options or {}) if self._checkpointer is not None else {}
        return {**base, **(self.storage_options or {}), **(per_call or {})}

    @staticmethod
    def _call_kwargs(options: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        return {} if options is None else {"storage_options": options}

    def _wait_for(self, path: _PATH) -> None:
        """A path whose save is still running is neither overwritten, read nor removed until it is
        committed (the checkpointer's own pending list; no bookkeeping here)."""
        ckpt = self.checkpointer
        if not ckpt.closed:
            key = _state.key_of(path)
            if any(_state.key_of(p) == key for p in ckpt.pending_paths()):
                ckpt.wait()

    def _restore_rng(self, checkpoint: Dict[str, Any]) -> Dict[str, Any]:
        record = checkpoint.pop(RECORD_KEY, None)
        if isinstance(record, dict) and self.restore_rng and record.get("rng") is not None:
            _state.restore_rng(record["rng"])
        return checkpoint

    def _record(self, checkpoint: Dict[str, Any]) -> Dict[str, Any]:
        rng = _state.collect_rng() if self.restore_rng else None
        return {"version": _RECORD_VERSION, "keys": [str(k) for k in checkpoint], "rng": rng}

    def _fallback_warning(self, path: _PATH, what: str) -> None:
        s = _state.scheme(path)
        if s not in self._warned_schemes:
            self._warned_schemes.add(s)
            rank_zero_warn(f"ByteCheckpointIO: {s}:// is an fsspec file system bytecheckpoint does not store to; "
                           f"checkpoints there are {what} as regular files by Lightning's TorchCheckpointIO. "
                           f"bytecheckpoint stores to local paths, file://, s3:// and gs://.")

    def __getstate__(self) -> Dict[str, Any]:
        """ddp_spawn pickles the trainer: engine objects are process-local. A passed checkpointer
        travels with every setting (Checkpointer.__reduce__) and is owned by the new process."""
        state = dict(self.__dict__)
        state["_owned"] = self._checkpointer if self._checkpointer is not None else self._owned
        state["_strategy_ref"] = None
        state["_template_for"] = None
        state["_checkpointer"] = None
        return state


def is_http_checkpoint(path: _PATH) -> bool:
    """A bytecheckpoint directory served over http(s) (loaded by the engine, read-only); any other
    http(s) URL (a .ckpt file) is Lightning's."""
    return _state.scheme(path) in _state.READ_ONLY_SCHEMES and _state.is_ours(bcp.default_checkpointer(), path)


def _check_options(options: Any, what: str) -> Optional[Dict[str, Any]]:
    """Lightning's contract: a CheckpointIO that cannot use the storage_options it is given
    raises TypeError. This plugin takes a dict of engine storage options."""
    if options is None:
        return None
    if not isinstance(options, Mapping):
        raise TypeError(f"ByteCheckpointIO: {what} must be a dict of bytecheckpoint storage options (e.g. "
                        f"{{'endpoint': 'http://...', 'region': ...}}, see docs/remote_storage.md), got "
                        f"{type(options).__name__} {options!r:.60}")
    return dict(options)


def _is_file(path: _PATH) -> bool:
    """A regular file (a Lightning .ckpt from before the switch)."""
    text = str(path)
    if "://" not in text or text.startswith("file://"):
        return os.path.isfile(_state.key_of(text))
    try:
        return bool(get_filesystem(text).isfile(text))
    except (ImportError, ValueError, OSError):  # no fsspec implementation or no answer: not a .ckpt file
        return False


def _replace_link_or_file(path: _PATH, legacy: TorchCheckpointIO) -> None:
    """Replace what TorchCheckpointIO's atomic rename would replace: a save_last="link" symlink
    (write a new checkpoint, not into its target) or an old .ckpt file."""
    if "://" in str(path) and not str(path).startswith("file://"):
        return
    local = _state.key_of(path)
    if os.path.islink(local):
        os.unlink(local)
    elif os.path.isfile(local):
        legacy.remove_checkpoint(local)


def _is_global_zero() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _to_device(checkpoint: Dict[str, Any], map_location: Any) -> Dict[str, Any]:
    """Apply a device ``map_location`` (bytecheckpoint returns CPU tensors; Lightning moves them)."""
    if not isinstance(map_location, (str, torch.device)):
        return checkpoint
    device = torch.device(map_location)

    def move(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.to(device)
        if isinstance(v, dict):
            return {k: move(x) for k, x in v.items()}
        if isinstance(v, list):
            return [move(x) for x in v]
        return v

    return move(checkpoint) if device.type != "cpu" else checkpoint
