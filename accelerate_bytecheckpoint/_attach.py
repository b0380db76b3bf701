"""Route ``Accelerator.save_state`` / ``load_state`` model and optimizer state through bytecheckpoint.

Mechanism (docs/accelerate.md has the whole story):

* ``save_state`` / ``load_state`` / ``end_training`` are wrapped on the *instance* (entries in
  ``accelerator.__dict__``; the class is untouched). While the original method runs, the
  optimizers list is swapped for an empty one (so Accelerate writes/reads no ``optimizer.bin``)
  and, for FSDP, the models list too (Accelerate would save/load them through DCP before any
  hook). Everything else (schedulers, RNG, samplers, GradScaler, registered objects, automatic
  naming, ``total_limit``) stays with Accelerate.
* Two pre-hooks per direction: the adapter's *first* hook runs before every user hook and its
  *last* hook after them. User hooks see Accelerate's real ``models`` / ``weights`` lists; what
  they pop (e.g. a model they save with ``save_pretrained``) is neither saved nor loaded by
  bytecheckpoint, exactly as Accelerate would not save or load it.
* Who writes follows Accelerate (see _routes.py): replicated state (no distributed setup, DDP) is
  saved by the main process alone (``process_group=bytecheckpoint.LOCAL``, so scripts may call
  ``save_state`` on the main process only or on every process) and loaded by each process alone;
  sharded state (FSDP, DTensor parameters), or DDP with ``collective_save=True``, is saved and
  loaded collectively, with every wait bounded by the checkpointer's ``timeout_s``.
* The bytecheckpoint save runs after Accelerate has written its own files, so the commit point
  (``<dir>/bytecheckpoint/metadata.json``) is written last.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any, Callable, Dict, List, Optional

import bytecheckpoint as bcp
from bytecheckpoint.adapters import deepspeed_folders, fsdp_folders
from bytecheckpoint.adapters.attachment import Attachment, check_target, checkpointer_for

from . import _agreement, _data, _staging
from ._agreement import CHECKPOINT_SUBDIR, LEGACY_MODEL_FILES, save_on_each_node
from . import _compat as compat
from . import _routes as routes
from ._metrics import MetricsLog, MetricsMixin

logger = logging.getLogger(__name__)

_WRAPPED_METHODS = ("save_state", "load_state", "end_training", "prepare_data_loader", "log")  # _data.py, _metrics.py


def _key(prefix: str, index: int) -> str:
    """Accelerate's own naming: model, model_1, ...; optimizer, optimizer_1, ..."""
    return prefix if index == 0 else f"{prefix}_{index}"


def _contains(items: List[Any], obj: Any) -> bool:
    return any(x is obj for x in items)


def _strip_compile(model: Any) -> Any:
    return getattr(model, "_orig_mod", model)  # torch.compile's wrapper; FSDP wrappers are kept


@dataclasses.dataclass
class _Call:
    """One save_state / load_state call in progress."""

    route: routes.Route
    models: list                        # Accelerate's real lists
    optimizers: list
    standin_optimizers: list            # the empty list Accelerate holds as `optimizers`
    weights: Optional[list] = None      # save: `weights` before any user hook
    kept: Optional[List[int]] = None    # save: indexes of the models bytecheckpoint writes
    directory: Optional[str] = None
    strict: bool = True


class ByteCheckpointAttachment(_data.DataOrderMixin, _staging.WarmUpMixin, MetricsMixin, Attachment):
    """Handle returned by :func:`attach`. ``remove()`` restores Accelerate's default behaviour.
    (checkpointer, active, async_save, pending, wait, remove and the context manager: Attachment.)"""

    def __init__(self, accelerator: Any, checkpointer: "bcp.Checkpointer", *, owns_checkpointer: bool,
                 async_save: Optional[bool], storage_options: Optional[dict], collective_save: bool,
                 log_metrics: Optional[bool] = None, metrics_step: Optional[Callable[[], int]] = None) -> None:
        self._metrics = MetricsLog(accelerator, log_metrics, metrics_step)  # checkpoint/... via accelerator.log
        super().__init__(checkpointer, owns_checkpointer=owns_checkpointer, async_save=async_save,
                         storage_options=storage_options)
        self._accelerator = accelerator
        # async_save per call for a shared checkpointer (an owned one was built with it).
        self._overrides: Dict[str, Any] = {}
        if async_save is not None and not owns_checkpointer:
            self._overrides["async_save"] = bool(async_save)
        self.collective_save = bool(collective_save)
        self._call: Optional[_Call] = None
        self._hooks: Dict[str, tuple] = {}

    # ------------------------------------------------------------------ public
    @property
    def accelerator(self) -> Any:
        return self._accelerator

    @property
    def storage_options(self) -> Optional[dict]:
        return self._storage.get("storage_options", self._ckpt.storage_options)

    def latest(self) -> Optional[str]:
        """With ``ProjectConfiguration(automatic_checkpoint_naming=True)``: the ``checkpoint_<n>``
        folder ``load_state()`` resumes from (the highest number whose bytecheckpoint part is
        committed, or a checkpoint saved without attach), or None when there is none yet (a first
        launch, or only torn folders). An async save counts once committed. This process alone;
        for an elastic restart (docs/elastic.md)::

            if attachment.latest() is not None:
                accelerator.load_state()
        """
        acc = self._accelerator
        if not acc.project_configuration.automatic_checkpoint_naming:
            raise ValueError("ByteCheckpointAttachment.latest() picks among the automatically named folders: use "
                             "Accelerator(project_config=ProjectConfiguration(project_dir=..., "
                             "automatic_checkpoint_naming=True)), or bytecheckpoint.latest(<dir>) for your own folders")
        return _agreement.latest_committed(acc, self._ckpt, self._storage)

    def __getstate__(self) -> Dict[str, Any]:
        """Pickling an attached Accelerator: the copy gets its own checkpointer with every setting
        (Checkpointer.__reduce__ builds a new, idle one) and owns it."""
        state = self.__dict__.copy()
        state.update(_owns=True, _call=None)
        return state

    def __repr__(self) -> str:
        return (f"ByteCheckpointAttachment(active={self._active}, async_save={self._async}, "
                f"collective_save={self.collective_save}, pending={len(self.pending)})")

    # ------------------------------------------------------------- install
    def _install(self) -> None:
        acc = self._accelerator
        for name in _WRAPPED_METHODS:
            # the class method (picklable) or an earlier instance patch
            self._wrap(acc, name, compat.method(acc, name), getattr(self, f"_wrapped_{name}"))
        for kind, register in (("save", acc.register_save_state_pre_hook), ("load", acc.register_load_state_pre_hook)):
            self._hooks[kind] = (register(getattr(self, f"_{kind}_hook_first")),
                                 register(getattr(self, f"_{kind}_hook_last")))
            self._order_hooks(kind)
        self._mark(acc)
        self._active = True

    def _uninstall(self) -> None:
        self._active = False
        for handles in self._hooks.values():
            for handle in handles:
                handle.remove()
        self._hooks.clear()
        self._restore()
        self._unmark(self._accelerator)

    def _order_hooks(self, kind: str) -> None:
        first, last = self._hooks[kind]
        compat.move_hook(self._accelerator, kind, first, first=True)
        compat.move_hook(self._accelerator, kind, last, first=False)

    # ------------------------------------------------------------- wrappers
    def _begin(self, kind: str, route: routes.Route) -> _Call:
        acc = self._accelerator
        self._order_hooks(kind)  # user hooks registered since the last call run between ours
        models, optimizers = compat.models(acc), compat.optimizers(acc)
        call = _Call(route, models, optimizers, standin_optimizers=[])
        compat.set_lists(acc, [] if route.models_before_hooks else models, call.standin_optimizers)
        self._call = call
        return call

    def _end(self, call: _Call) -> None:
        self._call = None
        compat.set_lists(self._accelerator, call.models, call.optimizers)

    def _wrapped_save_state(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        if not self._active or self._call is not None:
            return original(*args, **kwargs)
        # The previous save must be committed before Accelerate may prune folders (total_limit).
        self._ckpt.wait()
        _agreement.continue_naming(self._accelerator)  # never onto an existing (e.g. torn) checkpoint_<n>
        call = self._begin("save", routes.route_for(self._accelerator, compat.models(self._accelerator)))
        try:
            location = original(*args, **kwargs)
        finally:
            self._end(call)
        if call.directory is None or call.kept is None:
            raise RuntimeError("accelerate_bytecheckpoint: save_state ran without calling its pre-hooks; models and "
                               "optimizers were not saved. Was the hook removed by hand? remove() and attach again.")
        self._save(call)
        return location

    def _wrapped_load_state(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        if not self._active or self._call is not None:
            return original(*args, **kwargs)
        acc = self._accelerator
        self._ckpt.wait()  # loading what an async save of this process is still writing must see it committed
        _agreement.continue_naming(acc)  # the next save_state after a restart names a new folder
        route = routes.route_for(acc, compat.models(acc))
        if self._async and not route.sharded and acc.num_processes > 1:
            # The main process may have saved alone, asynchronously: everyone waits for it.
            _agreement.arrive(self._ckpt, "load_state", route, "(the main process's async save commits first)")
        if (args[0] if args else kwargs.get("input_dir")) is None:
            latest = _agreement.latest_committed(self._accelerator, self._ckpt, self._storage)
            if latest is not None:
                args, kwargs = ((latest, *args[1:]), kwargs) if args else (args, {**kwargs, "input_dir": latest})
        call = self._begin("load", route)
        # `strict` is meant for model.load_state_dict; bytecheckpoint honours it itself.
        call.strict = bool(kwargs.get("strict", True))
        try:
            return original(*args, **kwargs)
        finally:
            self._end(call)

    def _wrapped_end_training(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        if self._active:
            self._ckpt.wait()  # an async commit may still need the process group end_training destroys
            self._metrics.end()  # what no accelerator.log took, before the trackers finish
        return original(*args, **kwargs)

    # ------------------------------------------------------------------ hooks
    def _current(self, what: str) -> Optional[_Call]:
        if not self._active:
            return None
        if self._call is None:
            logger.warning("bytecheckpoint: Accelerator.%s ran without the attached wrapper (called on the class?); "
                           "Accelerate handles models and optimizers itself this time", what)
        return self._call

    def _save_hook_first(self, models: list, weights: list, output_dir: str) -> None:
        call = self._current("save_state")
        if call is None:
            return
        compat.set_lists(self._accelerator, call.models, call.optimizers)  # user hooks see the real lists
        call.weights = list(weights)

    def _save_hook_last(self, models: list, weights: list, output_dir: str) -> None:
        call = self._current("save_state")
        if call is None:
            return
        call.directory = os.fspath(output_dir)
        if call.route.models_before_hooks:  # FSDP: Accelerate builds no weights; every model is saved
            kept = list(range(len(call.models)))
        else:
            before = call.weights or []
            if len(before) != len(call.models):
                raise compat.AccelerateCompatError(
                    f"accelerate_bytecheckpoint: save_state built {len(before)} weights for {len(call.models)} "
                    f"models (accelerate {compat.version()}); expected one per model.")
            kept = [i for i, w in enumerate(before) if _contains(weights, w)]
            foreign = [w for w in weights if not _contains(before, w)]
            if foreign:
                logger.warning("bytecheckpoint: %d state dict(s) added to `weights` by a save hook are written by "
                               "Accelerate itself", len(foreign))
            weights[:] = foreign  # Accelerate writes none of the models bytecheckpoint saves
        if self._collective(call.route):
            kept = _agreement.agree(self._accelerator, self._ckpt, "save_state", call.route, call.directory, kept)
        call.kept = kept

    def _load_hook_first(self, models: list, input_dir: str) -> None:
        call = self._current("load_state")
        if call is not None:
            compat.set_lists(self._accelerator, call.models, call.optimizers)

    def _load_hook_last(self, models: list, input_dir: str) -> None:
        call = self._current("load_state")
        if call is None:
            return
        route = call.route
        if route.models_before_hooks:  # FSDP: Accelerate hands the hooks no models; every model is loaded
            targets = list(range(len(call.models)))
        else:
            targets = [i for i, m in enumerate(call.models) if _contains(models, m)]
        if route.sharded:
            _agreement.agree(self._accelerator, self._ckpt, "load_state", route, os.fspath(input_dir))
        path = os.path.join(os.fspath(input_dir), CHECKPOINT_SUBDIR)
        if not self._ckpt.is_checkpoint(path, **self._storage):
            if fsdp_folders.model_dirs(os.fspath(input_dir), len(call.models)):  # stock FSDP sharded folders (DCP)
                self._load_stock(call, os.fspath(input_dir), targets, models)
                return
            if route.optimizers_in_models and deepspeed_folders.accelerate_dirs(os.fspath(input_dir), len(call.models)):
                self._load_stock_deepspeed(call, os.fspath(input_dir), targets)  # stock DeepSpeed folders
                return
            self._hand_back_legacy(call, input_dir, path)
            return
        state = self._with_data(self._state(call, targets), path)  # + the loaders' data order, if saved
        group = {} if route.sharded else {"process_group": bcp.LOCAL}
        self._ckpt.load(path, state, strict=call.strict, **group, **self._storage)
        self._metrics.loaded(self._ckpt.last_load_stats)
        loaded = [call.models[i] for i in targets]
        models[:] = [m for m in models if not _contains(loaded, m)]  # Accelerate loads none of them again
        step = state.get("accelerator", {}).get("step")
        if step is not None:
            self._accelerator.step = int(step)
        logger.info("bytecheckpoint: models/optimizers loaded from %s", path)

    # ------------------------------------------------------------------ the local tier
    def save_local(self, step: int, *, async_save: bool = True) -> "bcp.SaveHandle":
        """Save to the local tier of the attached checkpointer (``bcp.Checkpointer(local_tier=
        bcp.LocalTier(...))``) as ``step_<step>``: the training step, which orders checkpoints
        (``accelerator.step`` counts gradient-accumulation steps only). Every process
        calls: each writes its share to its node and copies it to peer nodes (docs/local_tier.md).
        Saved: models, optimizers, LR schedulers, objects registered with
        ``register_for_checkpointing``, ``accelerator.step`` and the loaders' data order; not the
        per-process RNG states (those are in ``save_state``'s persistent folders only)."""
        self._require_tier("save_local")
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"save_local: step must be the training step (an int), got {step!r}")
        return self._ckpt.save(f"step_{step}", self._local_state(), tier="local", step=step, async_save=async_save)

    def restore(self, input_dir: Optional[str] = None) -> "bcp.Restored":
        """Resume from the newest complete checkpoint of the local tier (own parts and peer
        replicas, resharded to the current processes, no persistent read) or the persistent
        ``save_state`` folder ``input_dir`` (default: the newest committed one of automatic
        checkpoint naming), whichever is newer. Every process calls. When the persistent folder
        wins, ``load_state(folder)`` then restores what only it holds (RNG states, dataloaders):
        models and optimizers are read twice in that case."""
        self._require_tier("restore")
        self._ckpt.wait()
        folder = os.fspath(input_dir) if input_dir is not None else _agreement.latest_committed(self._accelerator, self._ckpt, self._storage)
        persistent = os.path.join(folder, CHECKPOINT_SUBDIR) if folder is not None else None
        state = self._local_state()
        # not strict: a persistent folder's bytecheckpoint part holds no schedulers or registered
        # objects (Accelerate's own files do; load_state below restores them)
        restored = self._ckpt.restore(state, persistent=persistent, strict=False, **self._storage)
        if restored.source == "persistent":
            self._accelerator.load_state(folder)
        elif restored.source == "local":
            self._accelerator.step = int(state["accelerator"]["step"])
        logger.info("bytecheckpoint: restored from the %s checkpoint %s%s", restored.source, restored.name,
                    f" ({restored.reason})" if restored.reason else "")
        return restored

    def _require_tier(self, what: str) -> None:
        if self._ckpt.local_tier is None:
            raise ValueError(f"{what} needs attach(accelerator, checkpointer=bcp.Checkpointer(local_tier="
                             "bcp.LocalTier(dir=...)))")

    def _local_state(self) -> Dict[str, Any]:
        acc = self._accelerator
        models = compat.models(acc)
        sharded = routes.route_for(acc, models).sharded
        unwrap = _strip_compile if sharded else functools.partial(compat.unwrap, acc)
        state: Dict[str, Any] = {_key("model", i): unwrap(m) for i, m in enumerate(models)}
        for j, optimizer in enumerate(compat.optimizers(acc)):
            state[_key("optimizer", j)] = getattr(optimizer, "optimizer", optimizer)
        for j, scheduler in enumerate(compat.schedulers(acc)):
            state[_key("scheduler", j)] = getattr(scheduler, "scheduler", scheduler)
        for j, obj in enumerate(compat.custom_objects(acc)):
            state[_key("custom", j)] = obj
        state["accelerator"] = {"step": int(acc.step)}
        return self._with_data(state)

    # ------------------------------------------------------------------ save / load
    def _collective(self, route: routes.Route) -> bool:
        return route.sharded or (self.collective_save and self._accelerator.num_processes > 1)

    def _writes(self) -> bool:
        """Replicated state: the processes Accelerate's own `save()` writes on."""
        acc = self._accelerator
        return bool(acc.is_main_process or (save_on_each_node(acc) and acc.is_local_main_process))

    def _save(self, call: _Call) -> None:
        collective = self._collective(call.route)
        if not collective and not self._writes():
            return
        path = os.path.join(call.directory, CHECKPOINT_SUBDIR)
        group = {} if collective else {"process_group": bcp.LOCAL}
        handle = self._ckpt.save(path, self._with_data(self._state(call, call.kept)), overwrite=True,  # as Accelerate
                                 **group, **self._overrides, **self._storage)
        self._metrics.saved(handle)
        logger.info("bytecheckpoint: models/optimizers %s to %s", "saving" if self._async else "saved", path)

    def _state(self, call: _Call, indexes: List[int]) -> Dict[str, Any]:
        acc = self._accelerator
        unwrap = _strip_compile if call.route.models_before_hooks else functools.partial(compat.unwrap, acc)
        state: Dict[str, Any] = {_key("model", i): unwrap(call.models[i]) for i in indexes}
        for j, optimizer in enumerate([] if call.route.optimizers_in_models else call.optimizers):
            # AcceleratedOptimizer keeps the real optimizer in `.optimizer`.
            state[_key("optimizer", j)] = getattr(optimizer, "optimizer", optimizer)
        # Plain value, stored per rank: ranks added on scale-up get rank 0's step (Accelerate
        # keeps `step` in the per-rank RNG file, which new ranks do not have).
        state["accelerator"] = {"step": int(acc.step)}
        return state

    def _load_stock(self, call: _Call, input_dir: str, targets: List[int], models: list) -> None:
        """Accelerate's own FSDP sharded folders, through the engine on this layout (adapters/fsdp_folders.py)."""
        acc = self._accelerator
        unwrap = _strip_compile if call.route.models_before_hooks else functools.partial(compat.unwrap, acc)
        group = {} if call.route.sharded else {"process_group": bcp.LOCAL}
        optimizers = [] if call.route.optimizers_in_models else call.optimizers
        loaded = fsdp_folders.load(self._ckpt, input_dir, [unwrap(m) for m in call.models], optimizers, targets, group,
                             self._storage)
        done = [call.models[i] for i in loaded]
        models[:] = [m for m in models if not _contains(done, m)]  # Accelerate loads none of them again
        logger.info("bytecheckpoint: models/optimizers loaded from Accelerate's FSDP sharded folders in %s", input_dir)

    def _load_stock_deepspeed(self, call: _Call, input_dir: str, targets: List[int]) -> None:
        """Accelerate's own DeepSpeed folders into these engines, at any process count and ZeRO stage
        (adapters/deepspeed_folders.py); schedulers, RNG and step stay Accelerate's own files."""
        dirs = deepspeed_folders.accelerate_dirs(input_dir, len(call.models))
        for i in targets:
            if i not in dirs:
                raise bcp.CheckpointNotFoundError(f"{input_dir}: no DeepSpeed folder for model {i} (found "
                                                  f"{sorted(os.path.basename(d) for d in dirs.values())})")
            deepspeed_folders.load_engine(self._ckpt, dirs[i], call.models[i], self._storage)
        logger.info("bytecheckpoint: DeepSpeed engines loaded from Accelerate's DeepSpeed folders in %s", input_dir)

    def _hand_back_legacy(self, call: _Call, input_dir: str, path: str) -> None:
        """A checkpoint written without attach: let Accelerate load models/optimizers itself."""
        acc = self._accelerator
        has_legacy = any(os.path.exists(os.path.join(input_dir, name)) for name in LEGACY_MODEL_FILES)
        if not has_legacy or call.route.models_before_hooks:
            hint = "Save it with an attached accelerator, or pass the directory save_state wrote."
            if not call.route.sharded and acc.num_processes > 1:
                hint = (f"This is process {acc.process_index}. Replicated models and optimizers are written by the "
                        "main process (and, with ProjectConfiguration(save_on_each_node=True), by each node's local "
                        "main process) into the directory it passed to save_state: load from that directory on "
                        "every process (a shared file system), or use save_on_each_node=True for node-local copies.")
            raise bcp.CheckpointNotFoundError(
                f"{input_dir!s} holds no bytecheckpoint checkpoint at {path!s} (and no Accelerate model files to "
                f"fall back to). {hint}")
        logger.warning("%s has no %s/ checkpoint; loading its models/optimizers with Accelerate's own loader",
                       input_dir, CHECKPOINT_SUBDIR)
        call.standin_optimizers.extend(call.optimizers)  # the list object Accelerate bound to `optimizers`


def attach(accelerator: Any, checkpointer: Optional["bcp.Checkpointer"] = None, *, async_save: Optional[bool] = None,
           storage_options: Optional[dict] = None, collective_save: bool = False, log_metrics: Optional[bool] = None,
           metrics_step: Optional[Callable[[], int]] = None, data_order: bool = True) -> ByteCheckpointAttachment:
    """Make ``accelerator.save_state`` / ``load_state`` write and read models and optimizers with
    bytecheckpoint (``<checkpoint dir>/bytecheckpoint``), reshardable to any process count.

    Call on every process, after creating the ``Accelerator`` (before or after ``prepare``).

    Args:
        checkpointer: a ``bytecheckpoint.Checkpointer`` to share (not closed by ``remove()``);
            default: one built with ``Checkpointer.from_env(...)`` and closed by ``remove()``.
        async_save: ``save_state`` returns once state is copied out; the write finishes in the
            background and is waited for by the next ``save_state`` / ``load_state`` /
            ``end_training`` or ``handle.wait()``. Default: the checkpointer's setting.
        storage_options: for remote storage (endpoint, credentials); default: the checkpointer's.
        collective_save: DDP / single-device types only: every process writes a balanced share
            of the replicated state, so ``save_state`` must be called on every process (a missing
            process is an error after ``timeout_s``). Default: the main process writes alone and
            ``save_state`` may be called on the main process only or on every process.
        log_metrics: ``checkpoint/...`` metrics with your next ``accelerator.log`` call, at its step
            (default on unless BCP_LOG_METRICS=0; docs/monitoring.md). ``metrics_step()``: the training
            step, for ``checkpoint/saved_step`` and what is left at ``end_training`` (default: the checkpoint count).
        data_order: every prepared loader keeps one global order on any process count, saved and
            restored with the checkpoint (docs/data.md); ``attachment.data_order``: the lines a load reported.
    """
    import accelerate

    check_target(accelerator, accelerate.Accelerator, "accelerate_bytecheckpoint", "an accelerate.Accelerator",
                 "Accelerator")
    compat.check(accelerator)
    routes.check_supported(accelerator)
    checkpointer, owns = checkpointer_for(checkpointer, "accelerate_bytecheckpoint", storage_options=storage_options,
                                          async_save=async_save)
    attachment = ByteCheckpointAttachment(accelerator, checkpointer, owns_checkpointer=owns, async_save=async_save,
                                          storage_options=storage_options, collective_save=collective_save,
                                          log_metrics=log_metrics, metrics_step=metrics_step)
    attachment._install()
    attachment._arm_warm_up()  # staging buffers allocated after the first optimizer step (_staging.py)
    attachment._data_setup(data_order)  # loaders prepared before attach get their order too
    return attachment
