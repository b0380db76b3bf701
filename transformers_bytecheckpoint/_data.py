"""The Trainer's data position (issue 32; docs/data.md, docs/transformers.md "Data order").

The stock Trainer resumes in global units over Accelerate's ``SeedableRandomSampler`` (its
default): ``epochs_trained = global_step // steps_per_epoch`` and ``(global_step % steps_per_epoch)
x gradient_accumulation_steps`` batches skipped with ``skip_first_batches``. That is exact, on any
process count, when the global batch (per-device batch x data-parallel processes x accumulation)
is kept. When it changed, the Trainer's step count lands elsewhere in the data, silently: each
checkpoint now records where the data stream stood (samples, global units), and a resume compares
it with where the Trainer is about to continue, in one line (a warning naming the samples trained
twice or skipped), or raises with ``attach(trainer, strict_data_order=True)``. Continuing by
sample count instead is not offered: it would change ``global_step``, which the LR schedule,
``max_steps`` and logging count in.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, Optional

from accelerate.data_loader import SeedableRandomSampler
from bytecheckpoint.data import DataPosition, Verdict, keep_hint
from torch.utils.data import BatchSampler, SequentialSampler

logger = logging.getLogger(__name__)


def _sampler(dl: Any) -> Any:
    bs = dl.sampler if isinstance(getattr(dl, "sampler", None), BatchSampler) else getattr(dl, "batch_sampler", None)
    return getattr(getattr(bs, "batch_sampler", bs), "sampler", None)


def _global_batch(trainer: Any) -> int:
    args = trainer.args
    total = getattr(trainer, "get_total_train_batch_size", None)
    if callable(total):
        return int(total(args))
    return int(args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps)


class _Run:
    """What a save records and a resume compares, from the prepared train loader."""

    def __init__(self, trainer: Any, train_dataloader: Any) -> None:
        args = trainer.args
        try:
            self.batches = len(train_dataloader)        # per-process batches per epoch
            self.dataset_len = len(train_dataloader.dataset)
        except TypeError:                               # an IterableDataset: no epoch length
            self.batches = self.dataset_len = None
        self.accumulation = int(args.gradient_accumulation_steps)
        self.global_batch = _global_batch(trainer)
        self.world = int(args.world_size)
        sampler = _sampler(train_dataloader)
        self.kind = ("seeded" if isinstance(sampler, SeedableRandomSampler) else
                     "sequential" if isinstance(sampler, SequentialSampler) else type(sampler).__name__)

    @property
    def steps_per_epoch(self) -> Optional[int]:
        """The Trainer's ``num_update_steps_per_epoch``."""
        if self.batches is None:
            return None
        return max(self.batches // self.accumulation + int(self.batches % self.accumulation > 0), 1)

    def position(self, global_step: int) -> Optional[DataPosition]:
        p = self.steps_per_epoch
        if p is None:
            return None
        consumed = min(global_step % p * self.global_batch, self.dataset_len)
        return DataPosition(epoch=global_step // p, consumed=consumed, dataset_len=self.dataset_len,
                            global_batch=self.global_batch, shuffle=self.kind != "sequential", world_size=self.world)

    def record(self, global_step: int) -> Optional[Dict[str, Any]]:
        pos = self.position(global_step)
        return None if pos is None else {**pos.to_state(), "order": self.kind}


def check(saved: Optional[Dict[str, Any]], run: _Run, trainer: Any) -> Verdict:
    """Where the Trainer is about to continue, against where the checkpoint's data stood."""
    gs, args = int(trainer.state.global_step), trainer.args
    if run.steps_per_epoch is None:
        return Verdict(False, "data order: not resharded: the train dataset has no length (IterableDataset); the "
                              "Trainer skips batches of its own stream")
    here = run.position(gs)
    if args.ignore_data_skip:
        return Verdict(False, f"data order: not resumed: ignore_data_skip=True; epoch {here.epoch} starts from its "
                              f"first batch (by request)")
    if not DataPosition.is_record(saved):
        return Verdict(False, f"data order: the checkpoint holds no data position (saved before this version); the "
                              f"Trainer resumes at epoch {here.epoch}, sample {here.consumed} by its step count alone")
    old = DataPosition.from_state(saved)
    if old.dataset_len != run.dataset_len:
        return Verdict(False, f"data order: not exact: the dataset has {run.dataset_len} samples, the checkpoint's had "
                              f"{old.dataset_len}")
    kind = saved.get("order")
    if kind != run.kind or kind not in ("seeded", "sequential"):
        if kind == run.kind and old.world_size == run.world and old.global_batch == run.global_batch:
            return Verdict(True, f"data order: exact on the same process count (the Trainer's own skip over a "
                                 f"{kind}, epoch {old.epoch}, {old.consumed}/{old.dataset_len} samples consumed)")
        return Verdict(False, f"data order: not exact: the checkpoint's order came from a {kind}, this run's from a "
                              f"{run.kind} on {run.world} processes (only Accelerate's seedable sampler, the Trainer's "
                              f"default, gives the same order on any process count)")
    n = old.dataset_len
    diff = (here.epoch * n + here.consumed) - (old.epoch * n + old.consumed)
    where = (f"the Trainer resumes at epoch {here.epoch}, sample {here.consumed} where the checkpoint stood at epoch "
             f"{old.epoch}, sample {old.consumed}")
    if old.global_batch == run.global_batch and diff == 0:
        return Verdict(True, f"data order: exact (epoch {old.epoch}, {old.consumed}/{n} samples consumed, "
                             f"{old.world_size} -> {run.world} processes)")
    change = (f"global batch {old.global_batch} -> {run.global_batch} ({args.per_device_train_batch_size} per device x "
              f"{run.world} process{'es' * (run.world != 1)} x {run.accumulation} accumulation)")
    if diff == 0:
        return Verdict(False, f"data order: continues by sample count (no sample replayed or skipped), not step for "
                              f"step: {change}")
    what = f"{-diff} samples trained twice" if diff < 0 else f"{diff} samples skipped"
    return Verdict(False, f"data order: not exact: {change}: {where}: {what}. The Trainer counts optimizer steps, and "
                          f"continuing by samples would change global_step, the LR schedule and max_steps; "
                          f"{keep_hint(old.global_batch, run.world)}",
                   replayed=max(0, -diff), skipped=max(0, diff))


class DataOrderMixin:
    """The data-order part of ``TrainerAttachment`` (_attach.py only calls it)."""

    _data_run: Optional[_Run] = None
    _strict_data_order = False
    #: the line the last resume reported (None before one)
    data_order: Optional[str] = None

    def _data_prepared(self, result: Any) -> Any:
        """``_prepare_for_training``'s (model, train_dataloader): the loader a save records."""
        if self._active and isinstance(result, tuple) and len(result) == 2:
            self._data_run = _Run(self._trainer, result[1])
        return result

    def _data_record(self) -> Optional[Dict[str, Any]]:
        run = self._data_run
        return None if run is None else run.record(int(self._trainer.state.global_step))

    def _data_check(self, info: Optional[Dict[str, Any]]) -> None:
        if self._data_run is None:
            return
        result = check((info or {}).get("data"), self._data_run, self._trainer)
        self.data_order = result.line
        if not result.exact and self._strict_data_order:
            raise ValueError(f"{result.line} (attach(trainer, strict_data_order=True))")
        if self._trainer.args.process_index == 0:
            logger.log(logging.INFO if result.exact else logging.WARNING, result.line)
