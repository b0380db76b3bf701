"""Route ``Accelerator.save_state`` / ``load_state`` model and optimizer state through bytecheckpoint.

Mechanism (see docs/accelerate.md):

* ``accelerator.save_state`` / ``load_state`` / ``end_training`` are wrapped on the *instance* (an
  entry in ``accelerator.__dict__``; the class is untouched). While the original method runs, the
  accelerator's ``_models`` / ``_optimizers`` lists are swapped for empty lists, so Accelerate
  itself writes/reads no model or optimizer files on any code path (plain, DDP, FSDP2: for FSDP
  Accelerate would otherwise save through DCP *before* any hook runs).
* A save pre-hook and a load pre-hook, registered first in Accelerate's hook dicts, receive the
  final checkpoint directory (after automatic naming / ``total_limit`` pruning). They put the real
  lists back (so later user hooks see them) and call ``bytecheckpoint.save`` / ``load`` on
  ``<dir>/bytecheckpoint`` with every model (unwrapped from DDP / torch.compile) and every
  optimizer (unwrapped from ``AcceleratedOptimizer``) in ONE state dict, so optimizer state is
  keyed by parameter name and reshards with the model.
* Everything else (schedulers, RNG, samplers/dataloader position, GradScaler, custom registered
  objects, ``automatic_checkpoint_naming`` and ``total_limit``) stays with Accelerate.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import bytecheckpoint as bcp

logger = logging.getLogger(__name__)

#: Name of the bytecheckpoint directory inside each Accelerate checkpoint directory.
CHECKPOINT_SUBDIR = "bytecheckpoint"

_ATTACHMENT_ATTR = "_bytecheckpoint_attachment"
_WRAPPED_METHODS = ("save_state", "load_state", "end_training")
_MISSING = object()
# Files Accelerate writes for models/optimizers when it handles them itself (legacy checkpoints).
_LEGACY_MODEL_FILES = ("model.safetensors", "pytorch_model.bin")


def _key(prefix: str, index: int) -> str:
    """Accelerate's own naming: model, model_1, ...; optimizer, optimizer_1, ..."""
    return prefix if index == 0 else f"{prefix}_{index}"


def _check_supported(accelerator: Any) -> None:
    from accelerate.utils import DistributedType

    dtype = accelerator.distributed_type
    if dtype in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise NotImplementedError(
            f"accelerate_bytecheckpoint.attach: distributed_type={dtype.value} saves models, "
            "optimizers and schedulers through its own engine checkpoint; bytecheckpoint cannot "
            "take them over. Use plain/DDP or FSDP2 (fsdp_version=2), or do not attach."
        )
    if dtype == DistributedType.XLA:
        raise NotImplementedError("accelerate_bytecheckpoint.attach: XLA/TPU is not supported.")
    if dtype == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise NotImplementedError(
            "accelerate_bytecheckpoint.attach: FSDP1 is not supported; set "
            "FullyShardedDataParallelPlugin(fsdp_version=2) (or `fsdp_version: 2` in the "
            "accelerate config) so parameters are DTensors that bytecheckpoint can reshard."
        )


class ByteCheckpointAttachment:
    """Handle returned by :func:`attach`. ``remove()`` restores Accelerate's default behaviour."""

    def __init__(self, accelerator: Any, *, async_save: bool, storage_options: dict | None) -> None:
        self._accelerator = accelerator
        self.async_save = bool(async_save)
        self.storage_options = storage_options
        self._active = False
        self._pending: Any = None  # SaveHandle of the last async save, until waited on
        # While a wrapped save_state/load_state runs: the real lists and the empty stand-ins.
        self._stash: tuple[list, list] | None = None
        self._hidden: tuple[list, list] | None = None
        self._load_strict = True
        self._previous: dict[str, Any] = {}
        self._hook_handles: list[Any] = []

    # ------------------------------------------------------------------ public
    @property
    def accelerator(self) -> Any:
        return self._accelerator

    @property
    def active(self) -> bool:
        return self._active

    @property
    def pending(self) -> Any:
        """The in-flight async ``SaveHandle`` (or ``None``)."""
        return self._pending

    def wait(self) -> None:
        """Block until the last async save is committed; re-raises its error, once."""
        handle, self._pending = self._pending, None
        if handle is not None:
            handle.wait()

    def remove(self) -> None:
        """Wait for a pending save, then restore Accelerate's own save/load behaviour."""
        if not self._active:
            return
        try:
            self.wait()
        finally:
            self._uninstall()

    def __enter__(self) -> "ByteCheckpointAttachment":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        return (
            f"ByteCheckpointAttachment(active={self._active}, async_save={self.async_save}, "
            f"pending={self._pending is not None})"
        )

    # ------------------------------------------------------------- install
    def _install(self) -> None:
        acc = self._accelerator
        for name in _WRAPPED_METHODS:
            self._previous[name] = acc.__dict__.get(name, _MISSING)
            original = getattr(acc, name)  # bound: the class method or an earlier instance patch
            wrapper = getattr(self, f"_wrapped_{name}")
            acc.__dict__[name] = functools.wraps(original)(functools.partial(wrapper, original))
        for register, hook, hook_dict in (
            (acc.register_save_state_pre_hook, self._save_hook, acc._save_model_state_pre_hook),
            (acc.register_load_state_pre_hook, self._load_hook, acc._load_model_state_pre_hook),
        ):
            handle = register(hook)
            hook_dict.move_to_end(handle.id, last=False)  # run before user hooks
            self._hook_handles.append(handle)
        setattr(acc, _ATTACHMENT_ATTR, self)
        self._active = True

    def _uninstall(self) -> None:
        acc = self._accelerator
        self._active = False
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        for name, previous in self._previous.items():
            current = acc.__dict__.get(name)
            if getattr(current, "func", None) is None or getattr(current.func, "__self__", None) is not self:
                # Someone wrapped the method again after attach: leave their wrapper; ours is
                # now a pass-through because self._active is False.
                continue
            if previous is _MISSING:
                del acc.__dict__[name]
            else:
                acc.__dict__[name] = previous
        self._previous.clear()
        if acc.__dict__.get(_ATTACHMENT_ATTR) is self:
            delattr(acc, _ATTACHMENT_ATTR)

    # ------------------------------------------------------------- wrappers
    @contextmanager
    def _models_hidden(self) -> Iterator[None]:
        acc = self._accelerator
        real = (acc._models, acc._optimizers)
        hidden: tuple[list, list] = ([], [])
        self._stash, self._hidden = real, hidden
        acc._models, acc._optimizers = hidden
        try:
            yield
        finally:
            self._stash = self._hidden = None
            acc._models, acc._optimizers = real

    def _wrapped_save_state(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        if not self._active:
            return original(*args, **kwargs)
        # Accelerate may rmtree older checkpoint directories (total_limit) before any hook runs,
        # and the previous save must be committed before a new one starts.
        self.wait()
        with self._models_hidden():
            return original(*args, **kwargs)

    def _wrapped_load_state(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        if not self._active:
            return original(*args, **kwargs)
        self.wait()  # loading what an async save is still writing must see it committed
        # `strict` is meant for model.load_state_dict; bytecheckpoint honours it itself (and it
        # stays in kwargs for Accelerate's loader should a legacy checkpoint be handed back).
        self._load_strict = bool(kwargs.get("strict", True))
        if (args[0] if args else kwargs.get("input_dir")) is None:
            latest = self._latest_committed()
            if latest is not None:
                if args:
                    args = (latest, *args[1:])
                else:
                    kwargs = {**kwargs, "input_dir": latest}
        with self._models_hidden():
            return original(*args, **kwargs)

    def _latest_committed(self) -> str | None:
        """With automatic naming, load_state() resumes from the newest checkpoint_<n> whose
        bytecheckpoint part was committed (an async save cut short by a crash leaves Accelerate's
        files without it); Accelerate itself would pick the newest folder, committed or not."""
        acc = self._accelerator
        if not acc.project_configuration.automatic_checkpoint_naming:
            return None
        base = os.path.join(acc.project_dir, "checkpoints")
        if not os.path.isdir(base):
            return None  # Accelerate raises its own error
        numbered = []
        for name in os.listdir(base):
            found = re.findall(r"([0-9]+)(?=[^/]*$)", name)  # Accelerate's ordering
            if found:
                numbered.append((int(found[0]), os.path.join(base, name)))
        skipped = []
        for _, folder in sorted(numbered, reverse=True):
            if self._loadable(folder):
                if skipped:
                    logger.warning("bytecheckpoint: skipping uncommitted checkpoint(s) %s; resuming from %s", skipped, folder)
                return folder
            skipped.append(folder)
        return None

    def _loadable(self, folder: str) -> bool:
        if bcp.is_checkpoint(os.path.join(folder, CHECKPOINT_SUBDIR), storage_options=self.storage_options):
            return True
        return not os.path.isdir(os.path.join(folder, CHECKPOINT_SUBDIR)) and any(
            os.path.exists(os.path.join(folder, name)) for name in _LEGACY_MODEL_FILES
        )

    def _wrapped_end_training(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        if self._active:
            self.wait()  # an async commit still needs the process group end_training destroys
        return original(*args, **kwargs)

    # ------------------------------------------------------------------ hooks
    def _take_stash(self, what: str) -> tuple[list, list]:
        if self._stash is None:
            raise RuntimeError(
                f"accelerate_bytecheckpoint: {what} ran without the attached wrapper (e.g. "
                f"Accelerator.{what}(accelerator, ...) on the class); call "
                f"accelerator.{what}(...) on the instance, or remove() the attachment first."
            )
        models, optimizers = self._stash
        # Give the real lists back now so hooks registered after ours see them; Accelerate's
        # own writer/reader already holds the empty stand-ins.
        self._accelerator._models, self._accelerator._optimizers = models, optimizers
        return models, optimizers

    def _state(self, models: list, optimizers: list) -> dict[str, Any]:
        acc = self._accelerator
        state: dict[str, Any] = {}
        for i, model in enumerate(models):
            state[_key("model", i)] = acc.unwrap_model(model, keep_fp32_wrapper=True, keep_torch_compile=False)
        for i, optimizer in enumerate(optimizers):
            # AcceleratedOptimizer keeps the real optimizer in `.optimizer`.
            state[_key("optimizer", i)] = getattr(optimizer, "optimizer", optimizer)
        # Plain value, stored per rank: ranks added on scale-up get rank 0's step (Accelerate
        # keeps `step` in the per-rank RNG file, which new ranks do not have).
        state["accelerator"] = {"step": int(acc.step)}
        return state

    def _save_hook(self, models: list, weights: list, output_dir: str) -> None:
        if not self._active:
            return
        models, optimizers = self._take_stash("save_state")
        path = os.path.join(os.fspath(output_dir), CHECKPOINT_SUBDIR)
        handle = bcp.save(
            path,
            self._state(models, optimizers),
            async_save=self.async_save,
            # Accelerate overwrites its own files when save_state targets an existing directory.
            overwrite=True,
            storage_options=self.storage_options,
        )
        if self.async_save:
            self._pending = handle
        logger.info("bytecheckpoint: models/optimizers %s to %s", "saving" if self.async_save else "saved", path)

    def _load_hook(self, models: list, input_dir: str) -> None:
        if not self._active:
            return
        real_models, real_optimizers = self._take_stash("load_state")
        path = os.path.join(os.fspath(input_dir), CHECKPOINT_SUBDIR)
        if not bcp.is_checkpoint(path, storage_options=self.storage_options):
            self._hand_back_legacy(models, real_models, real_optimizers, input_dir, path)
            return
        state = bcp.load(
            path,
            self._state(real_models, real_optimizers),
            strict=self._load_strict,
            storage_options=self.storage_options,
        )
        step = state.get("accelerator", {}).get("step")
        if step is not None:
            self._accelerator.step = int(step)
        logger.info("bytecheckpoint: models/optimizers loaded from %s", path)

    def _hand_back_legacy(self, models: list, real_models: list, real_optimizers: list, input_dir: str, path: str) -> None:
        """A checkpoint written without attach: let Accelerate load models/optimizers itself."""
        from accelerate.utils import DistributedType

        has_legacy = any(os.path.exists(os.path.join(input_dir, name)) for name in _LEGACY_MODEL_FILES)
        if not has_legacy or self._accelerator.distributed_type == DistributedType.FSDP:
            raise bcp.CheckpointError(
                f"{input_dir!s} holds no bytecheckpoint checkpoint at {path!s} (and no "
                "Accelerate model files to fall back to). Save it with an attached accelerator, "
                "or pass the directory save_state wrote."
            )
        logger.warning(
            "%s has no %s/ checkpoint; loading its models/optimizers with Accelerate's own loader",
            input_dir,
            CHECKPOINT_SUBDIR,
        )
        # _take_stash succeeded, so _models_hidden is active and self._hidden is set.
        models.extend(real_models)  # the list Accelerate's loader iterates
        self._hidden[1].extend(real_optimizers)  # the list object Accelerate bound to `optimizers`


def attach(accelerator: Any, *, async_save: bool = False, storage_options: dict | None = None) -> ByteCheckpointAttachment:
    """Make ``accelerator.save_state`` / ``load_state`` write and read models and optimizers with
    bytecheckpoint (``<checkpoint dir>/bytecheckpoint``), reshardable to any process count.

    Call on every process, after creating the ``Accelerator`` (before or after ``prepare``).
    With ``async_save=True`` ``save_state`` returns once state is copied out; the write finishes
    in the background and is waited for by the next ``save_state`` / ``load_state`` /
    ``end_training`` or ``handle.wait()``. ``handle.remove()`` restores the default behaviour.
    """
    if getattr(accelerator, _ATTACHMENT_ATTR, None) is not None:
        raise RuntimeError("accelerate_bytecheckpoint.attach: this Accelerator is already attached; remove() the first handle")
    for attr in ("_models", "_optimizers", "_save_model_state_pre_hook", "_load_model_state_pre_hook"):
        if not hasattr(accelerator, attr):
            raise TypeError(
                f"accelerate_bytecheckpoint.attach expects an accelerate.Accelerator (missing {attr!r}); got {type(accelerator).__name__}"
            )
    _check_supported(accelerator)
    attachment = ByteCheckpointAttachment(accelerator, async_save=async_save, storage_options=storage_options)
    attachment._install()
    return attachment
