"""Route ``transformers.Trainer`` checkpoints through bytecheckpoint.

Mechanism (docs/transformers.md has the whole story):

* Methods are wrapped on the *instance* (entries in ``trainer.__dict__``; the class and other
  Trainers are untouched; ``remove()`` restores them). Private ones are named in _compat.py only.
* Saving: the stock ``_save_checkpoint`` runs as always (folder ``checkpoint-<step>``, best
  checkpoint tracking, stateful callbacks, ``trainer_state.json``), except that inside it
  ``save_model`` writes the model's config, processing class and ``training_args.bin`` (the weights
  only where stock gathers them from shards: FSDP ``FULL_STATE_DICT``, DeepSpeed; _gathered.py),
  the optimizer/scheduler/scaler/RNG savers only record that the stock Trainer would save those
  parts, its rotation is held back and a Hub push is deferred. Then the adapter saves the parts
  through bytecheckpoint into ``checkpoint-<step>/bytecheckpoint`` (commit point last, after the
  Trainer's files, which are made durable first), async when asked, and rotates.
* Resuming: ``resume_from_checkpoint=True`` picks the newest *committed* folder. A folder written
  with the adapter is loaded right after ``accelerator.prepare`` (model or DeepSpeed engine,
  optimizer, scheduler, scaler: in place, any process count and layout) and its RNG states where
  the stock Trainer reads its RNG files. A folder the stock Trainer wrote is loaded by the stock
  code, so a run can switch to the adapter mid-way.
* ``enable_jit_checkpoint``: the checkpoint on SIGTERM is saved synchronously (committed and
  durable when the Trainer stops), after any pending async save.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from typing import Any, Callable, Dict, Optional

import torch

import bytecheckpoint as bcp
from bytecheckpoint.adapters import deepspeed_folders, fsdp_folders
from bytecheckpoint.adapters.attachment import Attachment, check_target, checkpointer_for
from bytecheckpoint.collectives.comm import Comm
from bytecheckpoint.state.flatten import top_level_placeholders

from . import _compat as compat
from . import _data
from . import _folders as folders
from . import _gathered as gathered
from . import _peft as peft
from . import _rng as rng
from . import _routes as routes
from . import _staging
from . import _views as views
from ._metrics import MetricsLog
from ._model_files import write_model_files

logger = logging.getLogger(__name__)
SCHEDULER_FILE = "scheduler.pt"  # transformers.trainer.SCHEDULER_NAME

_WRAPPED = ("train", "_save_checkpoint", "save_model", "_save_optimizer_and_scheduler", "_save_scaler",
            "_save_rng_state", "_push_from_checkpoint", "_load_from_checkpoint", "_prepare_for_training",
            "_load_optimizer_and_scheduler", "_load_rng_state", "_load_best_model", "_finalize_training")


@dataclasses.dataclass
class _SaveCall:
    """One `_save_checkpoint` in progress: what the stock method asked to be saved."""
    output_dir: Optional[str] = None
    optimizer: bool = False
    scaler: bool = False
    rng: bool = False
    push: Optional[str] = None


class TrainerAttachment(_data.DataOrderMixin, _staging.WarmUpMixin, Attachment):
    """Handle returned by :func:`attach`. ``remove()`` restores the Trainer's own checkpointing.
    (checkpointer, active, async_save, pending, wait, remove and the context manager: Attachment.)"""

    def __init__(self, trainer: Any, checkpointer: "bcp.Checkpointer", *, owns_checkpointer: bool,
                 async_save: Optional[bool], storage_options: Optional[dict], log_metrics: Optional[bool] = None,
                 metrics_in_log_history: bool = False) -> None:
        self._metrics = MetricsLog(trainer, log_metrics, metrics_in_log_history)  # checkpoint/... to the callbacks
        super().__init__(checkpointer, owns_checkpointer=owns_checkpointer, async_save=async_save,
                         storage_options=storage_options)
        self._trainer = trainer
        self._call: Optional[_SaveCall] = None
        self._sync_reason: Optional[str] = None   # "JIT checkpoint": this save is synchronous
        self._resumed: Optional[Dict[str, Any]] = None  # {"path", "trainer"} of the last bytecheckpoint resume
        self.last_save: Dict[str, float] = {}

    # ------------------------------------------------------------------ public
    @property
    def trainer(self) -> Any:
        return self._trainer

    def __repr__(self) -> str:
        return f"TrainerAttachment(active={self._active}, async_save={self._async}, pending={len(self.pending)})"

    # ------------------------------------------------------------------ install
    def _install(self) -> None:
        tr = self._trainer
        for name in _WRAPPED:
            wrapper = getattr(self, f"_w{name}" if name.startswith("_") else f"_w_{name}")
            self._wrap(tr, name, compat.method(tr, name), wrapper)
        for manager in compat.jit_managers(tr):
            self._wrap(manager, "execute_jit_checkpoint", manager.execute_jit_checkpoint, self._w_jit)
        self._mark(tr)
        self._metrics.install()
        self._active = True

    def _uninstall(self) -> None:
        self._active = False
        self._metrics.uninstall()
        self._restore()
        self._unmark(self._trainer)

    # ------------------------------------------------------------------ saving
    def _w_save_checkpoint(self, original: Callable, model: Any, trial: Any = None) -> None:
        if not self._active or self._call is not None:
            return original(model, trial)
        tr, args = self._trainer, self._trainer.args
        route = routes.route_for(tr)
        call = self._call = _SaveCall()
        limit, args.save_total_limit = args.save_total_limit, None  # rotation runs after the save, below
        try:
            original(model, trial)
        finally:
            args.save_total_limit = limit
            self._call = None
        if call.output_dir is None:
            raise compat.TransformersCompatError(
                f"transformers_bytecheckpoint: Trainer._save_checkpoint no longer calls save_model (transformers "
                f"{compat.version()}, tested {compat.TESTED}); nothing was saved through bytecheckpoint.")
        self._save(route, call, trial)

    def _save(self, route: routes.Route, call: _SaveCall, trial: Any) -> None:
        tr, args = self._trainer, self._trainer.args
        output_dir = call.output_dir
        sync = self._sync_reason is not None
        if sync:
            self._ckpt.wait()  # a pending async save commits first
        t0 = time.perf_counter()
        state = self._state(route, call)
        writes = route.collective or args.should_save
        if writes:
            group = {} if route.collective else {"process_group": bcp.LOCAL}
            # before the commit point: the Trainer's files durable, the weights file linked (_views.py)
            group.update(views.save_kwargs(state, route, folders.subdir(output_dir), output_dir, args.should_save))
            group.update(self._staging_kw)  # async_staging= for a shared checkpointer (_staging.py)
            handle = self._ckpt.save(folders.subdir(output_dir), state, overwrite=True, step=int(tr.state.global_step),
                                     async_save=False if sync else self._async, **group, **self._storage)
            self.last_save = dict(handle.stats, returned_s=time.perf_counter() - t0)
            self._metrics.saved(handle)
            logger.info("bytecheckpoint: checkpoint %s to %s", "saved" if sync or not self._async else "saving",
                        folders.subdir(output_dir))
            if call.push is not None:
                handle.wait()  # push a committed folder
        if call.push is not None:
            compat.method(tr, "_push_from_checkpoint")(call.push)
        if args.should_save:
            folders.rotate(self._ckpt, compat.output_dir(tr, trial), args.save_total_limit,
                           tr.state.best_model_checkpoint, self._storage)

    def _state(self, route: routes.Route, call: _SaveCall) -> Dict[str, Any]:
        tr, args = self._trainer, self._trainer.args
        state: Dict[str, Any] = _model_state(tr, route)
        if call.optimizer:
            if not route.optimizer_in_model:
                state["optimizer"] = getattr(tr.optimizer, "optimizer", tr.optimizer)
            if tr.lr_scheduler is not None:
                state["scheduler"] = getattr(tr.lr_scheduler, "scheduler", tr.lr_scheduler)
        scaler = getattr(tr.accelerator, "scaler", None)
        if call.scaler and scaler is not None:
            state["scaler"] = scaler
        info: Dict[str, Any] = {"global_step": int(tr.state.global_step), "world_size": int(args.world_size)}
        if call.rng:
            own = rng.capture(distributed=args.world_size > 1)
            if route.collective:
                info["rng"] = own
            else:
                info["rng_per_rank"] = self._comm("save").all_gather(own)
        info["data"] = self._data_record()  # where the data stream stands (global units; _data.py)
        state["trainer"] = info
        return state

    def _comm(self, what: str) -> Comm:
        """The default group, every wait bounded by the checkpointer's timeout_s."""
        comm = Comm(self._ckpt.process_group)
        comm.arrive(self._ckpt.options.timeout_s, f"Trainer checkpoint {what} (collective: every process calls it)")
        return comm

    # stock savers, inside a checkpoint: record, write nothing (the parts go through bytecheckpoint)
    def _w_save_model(self, original: Callable, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        call = self._call
        if not self._active or call is None or not _internal_call:
            return original(output_dir, _internal_call)
        call.output_dir = os.fspath(output_dir)
        route = routes.route_for(self._trainer)
        if not gathered.save(self._trainer, route, call.output_dir):  # FSDP FULL_STATE_DICT, DeepSpeed: as stock
            write_model_files(self._trainer, call.output_dir, peft.model_of(self._trainer, route))

    def _w_save_optimizer_and_scheduler(self, original: Callable, output_dir: str) -> None:
        if not self._active or self._call is None:
            return original(output_dir)
        self._call.optimizer = True

    def _w_save_scaler(self, original: Callable, output_dir: str) -> None:
        if not self._active or self._call is None:
            return original(output_dir)
        self._call.scaler = True

    def _w_save_rng_state(self, original: Callable, output_dir: str) -> None:
        if not self._active or self._call is None:
            return original(output_dir)
        self._call.rng = True
        os.makedirs(output_dir, exist_ok=True)  # as the stock method does, on every process

    def _w_push_from_checkpoint(self, original: Callable, checkpoint_folder: str) -> None:
        if not self._active or self._call is None:
            return original(checkpoint_folder)
        self._call.push = checkpoint_folder  # after the bytecheckpoint part is committed

    def _w_jit(self, original: Callable) -> None:
        if not self._active:
            return original()
        self._sync_reason = "JIT checkpoint"
        try:
            return original()
        finally:
            self._sync_reason = None

    # ------------------------------------------------------------------ resuming
    def _w_train(self, original: Callable, resume_from_checkpoint: Any = None, trial: Any = None,
                 ignore_keys_for_eval: Any = None, **kwargs: Any) -> Any:
        if self._active:
            self._ckpt.wait()
            if resume_from_checkpoint is True:
                resume_from_checkpoint = self._newest(self._trainer.args.output_dir)
        return original(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)

    def _newest(self, run_dir: str) -> str:
        find = functools.partial(folders.newest_committed, self._ckpt, run_dir, self._storage)
        comm = self._comm("resume") if _world(self._trainer) > 1 else Comm(bcp.LOCAL)
        newest = comm.run_on_coordinator(find, "finding the newest committed checkpoint")
        if newest is None:
            raise ValueError(f"No valid checkpoint found in output directory ({run_dir}) (bytecheckpoint: no "
                             f"committed checkpoint-<step> folder)")
        return newest

    def _w_load_from_checkpoint(self, original: Callable, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._active and folders.is_ours(resume_from_checkpoint):
            return None  # loaded right after accelerator.prepare (_w_prepare_for_training)
        if self._stock_fsdp(resume_from_checkpoint):
            path = fsdp_folders.model_dirs(resume_from_checkpoint, 1)[0]
            self._ckpt.load(path, {"model": model if model is not None else self._trainer.model},
                            process_group=bcp.LOCAL, **self._storage)
            logger.info("bytecheckpoint: the model loaded from the stock FSDP sharded folder %s", path)
            return None
        return original(resume_from_checkpoint, model)

    def _stock_fsdp(self, folder: Optional[str]) -> bool:
        """A folder the stock Trainer wrote under FSDP SHARDED_STATE_DICT (DCP directories), resumed
        without FSDP, which the stock Trainer cannot do: the engine reads them (adapters/fsdp_folders.py).
        Under FSDP the stock Trainer reads them itself, at any process count."""
        return (self._active and isinstance(folder, (str, os.PathLike)) and not folders.is_ours(folder)
                and not getattr(self._trainer, "is_fsdp_enabled", False)
                and bool(fsdp_folders.model_dirs(os.fspath(folder), 1)))

    def _stock_deepspeed(self, folder: Optional[str]) -> bool:
        """A folder the stock Trainer wrote under DeepSpeed (`latest` + global_step<N>/), resumed into
        this engine at any process count and ZeRO stage (adapters/deepspeed_folders.py); the stock
        Trainer needs the saved world size and stage."""
        return (self._active and isinstance(folder, (str, os.PathLike)) and not folders.is_ours(folder)
                and getattr(self._trainer, "is_deepspeed_enabled", False)
                and deepspeed_folders.is_folder(os.fspath(folder)))

    def _w_load_optimizer_and_scheduler(self, original: Callable, checkpoint: Optional[str]) -> None:
        if not self._stock_fsdp(checkpoint):
            return original(checkpoint)
        tr = self._trainer
        folder = os.fspath(checkpoint)
        fsdp_folders.load_optimizer(self._ckpt, os.path.join(folder, fsdp_folders.OPTIMIZER_DIR.format(0)), tr.model,
                                    tr.optimizer, {"process_group": bcp.LOCAL}, self._storage)
        scheduler = os.path.join(folder, SCHEDULER_FILE)
        if tr.lr_scheduler is not None and os.path.isfile(scheduler):  # as the stock Trainer loads it
            tr.lr_scheduler.load_state_dict(torch.load(scheduler, map_location="cpu", weights_only=True))
        logger.info("bytecheckpoint: optimizer and scheduler loaded from the stock FSDP sharded folder %s", folder)

    def _w_prepare_for_training(self, original: Callable, max_steps: int, train_dataloader: Any,
                                resume_from_checkpoint: Optional[str]) -> Any:
        if self._stock_deepspeed(resume_from_checkpoint):  # DeepSpeed's own folder, at any process count
            result = self._data_prepared(original(max_steps, train_dataloader, None))  # without the stock loads
            tr = self._trainer
            deepspeed_folders.load_engine(self._ckpt, os.fspath(resume_from_checkpoint), tr.model_wrapped,
                                          self._storage)
            tr._load_optimizer_and_scheduler(resume_from_checkpoint)  # stock: the scheduler's own file
            tr._load_scaler(resume_from_checkpoint)
            logger.info("bytecheckpoint: the DeepSpeed engine loaded from the stock folder %s", resume_from_checkpoint)
            return result
        if not self._active or resume_from_checkpoint is None or not folders.is_ours(resume_from_checkpoint):
            return self._data_prepared(original(max_steps, train_dataloader, resume_from_checkpoint))
        result = self._data_prepared(original(max_steps, train_dataloader, None))  # prepare without the stock loads
        self._load(resume_from_checkpoint)
        self._data_check(self._resumed["trainer"])  # where the data stream continues (_data.py)
        return result

    def _load(self, folder: str) -> None:
        tr = self._trainer
        route = routes.route_for(tr)
        path = folders.subdir(folder)
        comm = self._comm("load") if route.collective else Comm(bcp.LOCAL)
        md = comm.run(lambda: self._ckpt.metadata(path, **self._storage), f"reading {path}")
        saved = set(top_level_placeholders(md.structure))
        model_state = _model_state(tr, route, md)
        if not set(model_state) <= saved:
            other = "engine" if route.model_key == "model" else "model"
            raise bcp.StateMismatchError(
                f"{path} holds {sorted(saved)}: no {route.model_key!r}. "
                + (f"It was saved {'with' if other == 'engine' else 'without'} DeepSpeed; resume it with the same "
                   f"kind of training (DeepSpeed <-> non-DeepSpeed checkpoints do not convert)." if other in saved else
                   f"It holds a PEFT adapter: train the same peft.PeftModel (get_peft_model(base, config)) on one "
                   f"process or DDP to resume it." if peft.KEY in saved else
                   "It is not a Trainer checkpoint of this adapter."))
        if "model" in model_state and route is routes.REPLICATED and _custom_load_state_dict(_model(tr, route)):
            self._stock_model_load(path)
        state: Dict[str, Any] = dict(model_state)
        if "optimizer" in saved and not route.optimizer_in_model and tr.optimizer is not None:
            state["optimizer"] = getattr(tr.optimizer, "optimizer", tr.optimizer)
        if "scheduler" in saved and tr.lr_scheduler is not None:
            state["scheduler"] = getattr(tr.lr_scheduler, "scheduler", tr.lr_scheduler)
        scaler = getattr(tr.accelerator, "scaler", None)
        if "scaler" in saved and scaler is not None:
            state["scaler"] = scaler
        state["trainer"] = None
        group = {} if route.collective else {"process_group": bcp.LOCAL}
        self._ckpt.load(path, state, **group, **self._storage)
        self._metrics.loaded(self._ckpt.last_load_stats)
        self._resumed = {"path": os.path.abspath(folder), "trainer": state["trainer"]}
        logger.info("bytecheckpoint: resumed %s from %s", ", ".join(k for k in state if k != "trainer"), path)

    def _w_load_rng_state(self, original: Callable, checkpoint: Optional[str]) -> None:
        if not self._active or checkpoint is None or not folders.is_ours(checkpoint):
            return original(checkpoint)
        resumed = self._resumed
        if resumed is None or resumed["path"] != os.path.abspath(checkpoint):
            self._load(checkpoint)
            resumed = self._resumed
        args = self._trainer.args
        states = rng.pick(resumed["trainer"] or {}, args.world_size, args.process_index)
        if states is not None:
            from transformers.training_args import ParallelMode
            rng.restore(states, distributed=args.parallel_mode == ParallelMode.DISTRIBUTED)

    def _w_load_best_model(self, original: Callable) -> None:
        tr = self._trainer
        best = tr.state.best_model_checkpoint
        if not self._active or best is None or not folders.is_ours(best):
            return original()
        self._ckpt.wait()
        route = routes.route_for(tr)
        path = folders.subdir(best)
        logger.info(f"Loading best model from {best} (score: {tr.state.best_metric}).")
        model_state = _model_state(tr, route, self._ckpt.metadata(path, **self._storage))
        if "model" in model_state and route is routes.REPLICATED and _custom_load_state_dict(_model(tr, route)):
            self._stock_model_load(path)
            return
        group = {} if route.collective else {"process_group": bcp.LOCAL}
        # only the model (DeepSpeed: the engine, as the stock deepspeed_load_checkpoint loads it; PEFT: the adapters)
        self._ckpt.load(path, model_state, strict=False, **group, **self._storage)

    def _stock_model_load(self, path: str) -> None:
        """A model that overrides load_state_dict (it may resize buffers, rename or drop keys) gets
        it called as the stock Trainer calls it: with the saved state dict, strict=False, missing and
        unexpected keys logged. (On resume the in-place load that follows restores the optimizer
        by parameter name and writes the model's tensors again, with the same values.)"""
        model = _model(self._trainer, routes.REPLICATED)
        saved = self._ckpt.load_full(path, keys=["model"], process_group=bcp.LOCAL, **self._storage)["model"]
        result = model.load_state_dict(saved, False)
        for what, keys in (("missing", result.missing_keys), ("unexpected", result.unexpected_keys)):
            if keys:
                logger.warning(f"There were {what} keys in the checkpoint model loaded: {keys}.")

    def _w_finalize_training(self, original: Callable, trial: Any, num_train_samples: int, start_time: float) -> Any:
        if self._active:
            self._ckpt.wait()  # every checkpoint committed before the best one is loaded or others deleted
            args = self._trainer.args
            if args.should_save:  # what rotation kept while saves were in flight goes now, as stock would have
                folders.rotate(self._ckpt, compat.output_dir(self._trainer, trial), args.save_total_limit,
                               self._trainer.state.best_model_checkpoint, self._storage)
        return original(trial, num_train_samples, start_time)


def _model_state(trainer: Any, route: routes.Route, md: Optional["bcp.format.metadata.Metadata"] = None
                 ) -> Dict[str, Any]:
    """{"model": the model} ({"engine": ...} for DeepSpeed); a PeftModel: {"adapter": {name: view}}, the
    stock Trainer's adapter-only checkpoint (_peft.py). A load (`md`) follows what was saved: a
    checkpoint of a PEFT run that holds the whole model (written before adapter-only saves) loads it."""
    model = peft.model_of(trainer, route)
    if model is None or (md is not None and peft.KEY not in top_level_placeholders(md.structure)):
        return {route.model_key: _model(trainer, route)}
    return {peft.KEY: peft.views(model, None if md is None else md.tensors)}


def _model(trainer: Any, route: routes.Route) -> Any:
    if route is routes.DEEPSPEED:
        return trainer.model_wrapped  # the DeepSpeedEngine
    return getattr(trainer.model, "_orig_mod", trainer.model)  # FSDP: the wrapped root; torch.compile stripped


def _custom_load_state_dict(model: Any) -> bool:
    import torch

    return type(model).load_state_dict is not torch.nn.Module.load_state_dict


def _world(trainer: Any) -> int:
    return int(trainer.args.world_size)


def attach(trainer: Any, checkpointer: Optional["bcp.Checkpointer"] = None, *, async_save: Optional[bool] = None,
           storage_options: Optional[dict] = None, log_metrics: Optional[bool] = None,
           strict_data_order: bool = False, async_staging: Optional[bool] = None,
           metrics_in_log_history: bool = False) -> TrainerAttachment:
    """Make ``trainer`` save and resume checkpoints through bytecheckpoint (``checkpoint-<step>/
    bytecheckpoint``), reshardable to any process count and layout.

    Call on every process, after building the ``Trainer`` (before ``train()``).

    Args:
        checkpointer: a ``bytecheckpoint.Checkpointer`` to share (not closed by ``remove()``);
            default: one built with ``Checkpointer.from_env(...)`` and closed by ``remove()``.
        async_save: a checkpoint returns once the state is copied out; writing and commit finish
            in the background (waited for by the end of ``train()``, ``wait()`` and ``remove()``).
            Default: the checkpointer's setting. JIT checkpoints (SIGTERM) are always synchronous.
        storage_options: for remote storage; default: the checkpointer's.
        log_metrics: ``checkpoint/...`` metrics (stall, save/load seconds, bytes, throughput) to the
            ``report_to`` integrations and the console, with the Trainer's next log (default on unless
            BCP_LOG_METRICS=0; docs/monitoring.md).
        metrics_in_log_history: also record them in ``state.log_history`` (trainer_state.json), as
            entries of their own (default: kept out of it, so resumed and uninterrupted runs compare equal).
        strict_data_order: a resume whose data would not continue step for step (a changed global
            batch) raises instead of warning; ``attachment.data_order`` holds the line (docs/data.md).
        async_staging: with async_save, the optimizer's tensors are copied behind the next forward and
            backward and its step waits for them (docs/async_staging.md). Default: the checkpointer's
            ("auto": on for GPU tensors). Either way the staging buffers are allocated after the first
            optimizer step, in the background, not by the first checkpoint.
    """
    from transformers import Trainer

    check_target(trainer, Trainer, "transformers_bytecheckpoint", "a transformers.Trainer", "Trainer")
    compat.check(trainer)
    routes.route_for(trainer)
    args = trainer.args
    if args.save_on_each_node and routes.route_for(trainer).collective and args.world_size > 1:
        raise ValueError(
            "transformers_bytecheckpoint.attach: save_on_each_node=True with sharded (FSDP/DeepSpeed/DTensor) "
            "state: every process writes its part into one folder, so the folder must be on a file system all "
            "nodes share. Set save_on_each_node=False (TrainingArguments), or do not attach.")
    checkpointer, owns = checkpointer_for(checkpointer, "transformers_bytecheckpoint", storage_options=storage_options,
                                          async_save=async_save, async_staging=async_staging)
    attachment = TrainerAttachment(trainer, checkpointer, owns_checkpointer=owns, async_save=async_save,
                                   storage_options=storage_options, log_metrics=log_metrics,
                                   metrics_in_log_history=metrics_in_log_history)
    attachment._strict_data_order = bool(strict_data_order)
    attachment._install()
    attachment._staging_setup(async_staging, owns)
    return attachment
