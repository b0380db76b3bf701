"""ByteCheckpointManager: torchtitan's checkpoint contract (BaseCheckpointManager) on bytecheckpoint.

In the user's torchtitan config, one line:

    checkpoint=ByteCheckpointManager.Config(enable=True, interval=500, async_mode="async")

Every field of torchtitan's shared checkpoint Config keeps its meaning; `async_mode` takes the DCP
manager's values; `async_staging` and `storage_options` are bytecheckpoint's. Checkpoints are
`<dump_folder>/<folder>/step-<N>` directories (or s3://... prefixes), each a bytecheckpoint
checkpoint saved by every rank (its own shards), resumable on another layout and world size.
"""
from __future__ import annotations

import logging
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, Literal, Optional

import torch
import torch.distributed as dist

import bytecheckpoint as bcp
from bytecheckpoint.adapters.staging import WarmUpMixin, per_call

from . import _compat, _data, _dcp, _hf
from ._compat import BaseCheckpointManager, filesystem

log = logging.getLogger("torchtitan_bytecheckpoint")
# the keys of a checkpoint, torchtitan's own (components/checkpointer/base.py)
MODEL, OPTIMIZER, LR_SCHEDULER = "model", "optimizer", "lr_scheduler"
DATALOADER, TRAIN_STATE = "dataloader", "train_state"
_ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
_STEP = re.compile(r"^step-(\d+)$")
_COMMIT_FILES = ("metadata.json", ".metadata")  # ours; torchtitan's own DCP manager's


class ByteCheckpointManager(WarmUpMixin, BaseCheckpointManager):
    """torchtitan's checkpoint manager on bytecheckpoint (see the module docstring and docs/torchtitan.md).

    Saves {"model": the model parts, "optimizer": one torch optimizer per part, "lr_scheduler",
    "dataloader": each DP rank's stream position, "train_state", and any other state torchtitan
    hands over}. Model and optimizer state are keyed by parameter name, so a resume may use
    another FSDP/TP/PP layout and world size; the data stream follows a whole shrink of the
    data-parallel degree exactly (`data_order_report` says what the last resume did).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """"disabled": save() returns once written and committed. "async": once the state is copied
        out; writes and commit run in the background. "async_with_pinned_mem" (the DCP manager's
        staging overlapped with training): "async" plus async staging, the copy itself made behind
        the next forward/backward (the optimizer step waits for it, never the loop otherwise)."""

        async_staging: bool | None = None
        """Override async staging (None: on for "async_with_pinned_mem", off otherwise)."""

        storage_options: dict[str, str] | None = None
        """Endpoint, region and credentials for an object-store folder (s3://, gs://)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            mode = str(self.async_mode).lower()
            if mode not in _ASYNC_MODES:
                raise ValueError(f"Invalid async_mode: {self.async_mode!r}; one of {_ASYNC_MODES}")
            self.async_mode = mode
            if self.initial_load_in_hf_quantized:
                raise ValueError("ByteCheckpointManager: initial_load_in_hf_quantized is not supported; load "
                                 "quantized Hugging Face checkpoints with torchtitan's CheckpointManager")

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list, optimizers: Any, lr_schedulers: Any,
                 states: Dict[str, Any], sd_adapter: Any = None, base_folder: str = "",
                 checkpointer: Optional[bcp.Checkpointer] = None) -> None:
        self.enable = config.enable
        self.save_future = None
        self._purger: Optional[ThreadPoolExecutor] = None  # rank 0's retention thread, made on first use
        if not self.enable:
            return
        self.config = config
        self.folder = filesystem.join(base_folder, config.folder) if base_folder else config.folder
        self.interval = config.interval
        self.model_parts = list(model_parts)
        self.optimizers = optimizers
        self.states = dict(states)
        self.states.update({DATALOADER: dataloader, LR_SCHEDULER: lr_schedulers})
        self.export_dtype = _compat.TORCH_DTYPE_MAP[config.export_dtype]
        self.sd_adapter = sd_adapter
        if (config.last_save_in_hf or config.initial_load_in_hf) and sd_adapter is None:
            raise ValueError("checkpoint.last_save_in_hf / initial_load_in_hf need the model's state dict adapter "
                             "(its ModelSpec.state_dict_adapter), and sd_adapter is not provided.")
        self.data_order_report = ""
        self._async = config.async_mode != "disabled"
        staging = config.async_staging
        if staging is None:
            staging = config.async_mode == "async_with_pinned_mem"
        self._owns = checkpointer is None
        self._ckpt = checkpointer if checkpointer is not None else bcp.Checkpointer(
            storage_options=config.storage_options, async_save=self._async, async_staging=bool(staging))
        self._staging = per_call(bool(staging), self._owns)
        if self._async:
            self._arm_warm_up()  # core's trigger: plan and allocate staging once every optimizer stepped
        log.info("bytecheckpoint: checkpoints are loaded from and saved to %s (async_mode=%s, async staging %s)",
                 self.folder, config.async_mode, "on" if staging else "off")

    def __del__(self) -> None:
        self.close()

    # ------------------------------------------------------------------ what a checkpoint holds
    def _optimizer_list(self) -> list:
        return list(getattr(self.optimizers, "optimizers", [self.optimizers]))

    def _full_state(self, exclude=()) -> Dict[str, Any]:
        state: Dict[str, Any] = {MODEL: self.model_parts}
        if OPTIMIZER not in exclude:
            state[OPTIMIZER] = self._optimizer_list()
        for key, value in self.states.items():
            if key in exclude or value is None:
                continue
            positions = _data.dp_states(value) if key == DATALOADER else None
            if positions is not None:
                trainer = self.states.get(TRAIN_STATE)
                layout = _compat.layout(trainer, value) if _compat.is_trainer(trainer) else {}
                state[key] = _data.save_state(positions, layout)
            else:
                state[key] = value  # a Stateful of another form: its state_dict() per rank
        return state

    def _model_only_state(self) -> Dict[str, Any]:
        if not any(isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != self.export_dtype
                   for m in self.model_parts for v in m.state_dict().values()):
            return {MODEL: self.model_parts}  # already in export_dtype: the modules themselves
        cast = {}
        for part in self.model_parts:
            for name, value in part.state_dict().items():
                floating = isinstance(value, torch.Tensor) and value.is_floating_point()
                cast[name] = value.to(self.export_dtype) if floating else value
        return {MODEL: cast}

    # ------------------------------------------------------------------ save
    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.config.load_only:
            return False
        if curr_step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.interval == 0

    def _path(self, step: int) -> str:
        return filesystem.join(self.folder, f"step-{step}")

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        begin = time.monotonic()
        path = self._path(curr_step)
        if last_step and self.config.last_save_in_hf:
            _hf.save_last(self._ckpt, path, self._model_only_state(), self.sd_adapter)
        elif last_step and self.config.last_save_model_only:
            log.info("bytecheckpoint: saving a model-only checkpoint in %s at the last step, step %d",
                     self.export_dtype, curr_step)
            self._ckpt.save(path, self._model_only_state(), async_save=False, step=curr_step)
        elif last_step:
            self._ckpt.save(path, self._full_state(), async_save=False, step=curr_step)
        else:
            handle = self._ckpt.save(path, self._full_state(), step=curr_step, **self._staging)
            if self._async:
                self.save_future = handle
        self._purge_stale_checkpoints()
        log.info("bytecheckpoint: %s step %d in %.2f seconds", "staged" if self._async and not last_step else "saved",
                 curr_step, time.monotonic() - begin)
        return True

    def _purge_stale_checkpoints(self) -> None:
        """keep_latest_k: the newest k committed checkpoints stay; one still being written is not
        committed, so it is never counted or deleted. Rank 0 deletes on a thread of its own, off the
        training loop, as torchtitan's manager does (its purge thread); a failed deletion is logged and
        the next save's retention tries again. close() waits for it."""
        k = self.config.keep_latest_k
        if k > 0 and (not dist.is_initialized() or dist.get_rank() == 0):
            if self._purger is None:
                self._purger = ThreadPoolExecutor(1, thread_name_prefix="bcp-torchtitan-purge")
            self._purger.submit(self._purge, k)

    def _purge(self, k: int) -> None:
        try:
            self._ckpt.keep_last(self.folder, k, process_group=bcp.LOCAL)
        except Exception as exc:  # noqa: BLE001 - a deletion that failed must not stop training
            log.warning("bytecheckpoint: deleting checkpoints beyond keep_latest_k=%d in %s failed: %s; the next "
                        "save tries again", k, self.folder, exc)

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: with async staging bytecheckpoint's fence holds the optimizer step
        itself until its copy landed (no double wait); without it save() returned after the copy."""

    # the automatic staging warm-up (bytecheckpoint.adapters.staging.WarmUpMixin): after the first
    # step of every part's optimizer, every rank plans its own share of the full state (collective)
    @property
    def active(self) -> bool:
        return bool(getattr(self, "enable", False)) and not self._ckpt.closed

    def _warm_up_optimizers(self) -> list:
        return self._optimizer_list()

    def _warm_up_plan(self):
        return True, self._full_state

    def _wait_for_saving(self) -> None:
        """Every pending save has committed (or its error is raised here); retention catches up
        with the ones that were still being written at their save()."""
        try:
            self._ckpt.wait()
        finally:
            self.save_future = None
        self._purge_stale_checkpoints()

    def _close(self) -> None:
        if getattr(self, "_ckpt", None) is None or self._ckpt.closed:
            return
        try:
            self._wait_for_saving()
        finally:
            if self._purger is not None:
                self._purger.shutdown(wait=True)
                self._purger = None
            if self._owns:
                self._ckpt.close()

    # ------------------------------------------------------------------ load
    def _newest(self) -> Optional[int]:
        """The step of the newest committed checkpoint in the folder (bcp.latest: local or remote);
        newer saves that did not finish (no commit point) are logged and skipped."""
        path = self._ckpt.latest(self.folder)
        step = None
        if path is not None:
            match = _STEP.match(str(path).rstrip("/").rsplit("/", 1)[-1])
            step = int(match.group(1)) if match else self._ckpt.inspect(path).info.get("step")
        if "://" not in self.folder and os.path.isdir(self.folder):
            for name in sorted(os.listdir(self.folder)):
                match, newer = _STEP.match(name), os.path.join(self.folder, name)
                hf = os.path.exists(os.path.join(newer, "model.safetensors"))  # last_save_in_hf
                if not match or hf or (step is not None and int(match.group(1)) <= step):
                    continue
                if any(os.path.exists(os.path.join(newer, f)) for f in _COMMIT_FILES):
                    try:  # committed but unreadable: an error naming it, never an older or fresh start
                        self._ckpt.metadata(newer)
                    except bcp.CheckpointError as exc:
                        raise bcp.CheckpointError(f"the newest checkpoint {newer} cannot be read, so the run cannot "
                                                  f"resume from it: {exc}") from exc
                    continue
                log.warning("bytecheckpoint: %s is not a committed checkpoint (no metadata.json or DCP .metadata: "
                            "a save that did not finish); skipped", newer)
        return step

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        if step != -1:
            path = self._path(step)
            if not self._ckpt.is_checkpoint(path):
                raise FileNotFoundError(f"--checkpoint.load_step={step}: no committed checkpoint at {path}")
        else:
            step = self._newest()
            step = -1 if step is None else step
            path = self._path(step)
        if step == -1:
            if self.config.initial_load_in_hf:
                hf_dir = self.config.initial_load_path or getattr(self.sd_adapter, "hf_assets_path", None)
                if not hf_dir or not os.path.isdir(hf_dir):
                    raise ValueError(f"initial_load_in_hf: no Hugging Face folder at {hf_dir!r} (initial_load_path "
                                     f"or model.hf_assets_path)")
                log.info("bytecheckpoint: loading the model from Hugging Face safetensors in %s", hf_dir)
                os.makedirs(self.folder, exist_ok=True)
                _hf.load_initial(self._ckpt, hf_dir, self.model_parts, self.sd_adapter, self.folder)
                return True
            if not self.config.initial_load_path:
                log.info("bytecheckpoint: no checkpoint in %s, this is a fresh start", self.folder)
                return False
            path, model_only = self.config.initial_load_path, self.config.initial_load_model_only
            if not self._ckpt.is_checkpoint(path):
                raise ValueError(f"checkpoint.initial_load_path is not a committed checkpoint (bytecheckpoint or "
                                 f"PyTorch DCP): {path}")
        else:
            model_only = step == 0
        begin = time.monotonic()
        log.info("bytecheckpoint: loading %s%s", path, " (model only)" if model_only else "")
        if _dcp.is_dcp(self._ckpt, path):  # written by torchtitan's own (DCP) manager: its key layout
            report = _dcp.load(self._ckpt, path, model_parts=self.model_parts, optimizers=self.optimizers,
                               states=self.states, exclude=set(self.config.exclude_from_loading), model_only=model_only)
            if report:
                self.data_order_report = report
                log.info("bytecheckpoint: %s", report)
        elif model_only:
            self._ckpt.load(path, {MODEL: self.model_parts}, strict=False)
        else:
            self._load_full(path)
        log.info("bytecheckpoint: loaded %s in %.2f seconds", path, time.monotonic() - begin)
        return True

    def _load_full(self, path: str) -> None:
        exclude = set(self.config.exclude_from_loading)
        unknown = exclude - set(self.states) - {OPTIMIZER}
        if unknown:
            raise ValueError(f"{sorted(unknown)} not found in state_dict.")
        state = self._full_state(exclude | {DATALOADER})
        loader, plan = self.states.get(DATALOADER), None
        if loader is not None and DATALOADER not in exclude:
            if _data.dp_states(loader) is not None:
                dp_rank, dp_world = _compat.dp_coordinates(loader)
                plan = _data.plan_for(self._ckpt.inspect(path), DATALOADER, dp_rank, dp_world)
            state[DATALOADER] = plan.template() if plan is not None else loader
        self._ckpt.load(path, state, strict=not exclude)
        if plan is None:
            return
        trainer = self.states.get(TRAIN_STATE)
        layout = _compat.layout(trainer, loader) if _compat.is_trainer(trainer) else {}
        resumed, self.data_order_report = _data.restore(plan, loader, trainer, layout)
        if resumed is not loader:
            _compat.replace_dataloader(trainer, resumed)
            self.states[DATALOADER] = resumed
        (log.info if not plan.why else log.warning)("bytecheckpoint: %s", self.data_order_report)
