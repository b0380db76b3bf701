"""The train loader's order and position, saved with every checkpoint and resumed on any device
count (issue 32; docs/data.md, docs/lightning.md "Data order").

``Strategy.process_dataloader`` (public; every Lightning strategy but XLA's inherits it) is wrapped
once at class level (_compat.py). For the train loader of a Trainer whose plugin is a
``ByteCheckpointIO(data_order=True)``, the sampler Lightning injected (``DistributedSampler``) or,
on one device, the user's ``RandomSampler`` / ``SequentialSampler`` is replaced by an
``ElasticSampler`` with the same settings (Lightning's own ``_update_dataloader`` rebuilds the
loader), and the loader becomes stateful (``state_dict`` / ``load_state_dict``): Lightning saves
its position with the fit loop (``loops.fit_loop.state_dict.combined_loader``) and hands it back
before the first batch of a resumed run. Runs on an unchanged device count see exactly the
batches they see without the plugin (DistributedSampler's streams); a one-device run draws
DistributedSampler's order (seeded ``PL_GLOBAL_SEED + epoch``) instead of the global RNG's.
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Optional, Tuple

from bytecheckpoint.data import DataPosition, ElasticSampler, StatefulLoaderMixin, Verdict, keep_hint, make_stateful
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from . import _compat
from .checkpoint_io import ByteCheckpointIO


def install_hooks() -> None:
    """Idempotent (the package's __init__ calls it)."""
    _compat.hook_process_dataloader(Strategy, process_train_loader)


class _LightningLoader(StatefulLoaderMixin):
    """The stateful loader mixin reporting to the plugin (``ByteCheckpointIO.data_order_report``),
    with what Lightning's batch counters make of a changed global batch."""

    _bcp_io: Optional[weakref.ref] = None
    _bcp_trainer: Optional[weakref.ref] = None
    _bcp_checked = False

    def _on_resume(self, saved: DataPosition, result: Verdict) -> Verdict:
        self._bcp_checked = True
        trainer = self._bcp_trainer() if self._bcp_trainer is not None else None
        if trainer is not None and not result.exact:
            result = _untrained_tail(self, trainer, saved, result) or result
        _report(self._bcp_io, result)
        return result

    def __getstate__(self) -> dict:
        # the plugin and trainer are weak references (not picklable, and local to this process)
        return {k: v for k, v in self.__dict__.items() if k not in ("_bcp_io", "_bcp_trainer")}

    def __iter__(self):
        if not self._bcp_checked:  # the first pass of a resume whose checkpoint handed no position over
            self._bcp_checked = True
            trainer = self._bcp_trainer() if self._bcp_trainer is not None else None
            if trainer is not None and trainer.ckpt_path is not None:
                self.data_order = _without_record(trainer, self)
                _report(self._bcp_io, self.data_order)
        return super().__iter__()


def _untrained_tail(loader: StatefulLoaderMixin, trainer: Any, saved: DataPosition, result: Verdict) -> Optional[Verdict]:
    """Lightning ends the epoch after ``len(loader)`` batches in all (its batch counter continues
    from the saved step), before the rest of the epoch is trained: with a larger global batch, or
    another dataset length (the sampler then starts the epoch from its first sample)."""
    sampler = loader.elastic_sampler
    n, start = len(sampler.dataset), sampler.resume_at
    g_new = (loader.batch_size or 1) * sampler.num_replicas
    done = trainer.fit_loop.epoch_loop.batch_progress.current.ready  # this epoch's batches Lightning counts as run
    untrained = (n - start) - max(0, len(loader) - done) * g_new
    if untrained <= 0:
        return None
    ends = (f"Lightning ends epoch {sampler.epoch} after {len(loader)} batches (its count goes on from {done}), so "
            f"{untrained} of its {n} samples are never trained")
    if saved.dataset_len != n:
        return Verdict(False, f"{result.line}, but {ends}", skipped=untrained)
    return Verdict(False, f"data order: not exact: global batch {saved.global_batch} -> {g_new}: {ends}; "
                          f"{keep_hint(saved.global_batch, sampler.num_replicas)}", skipped=untrained)


def _without_record(trainer: Any, loader: StatefulLoaderMixin) -> Verdict:
    """A resume Lightning handed no position: at an epoch's start (an epoch-end checkpoint; Lightning
    hands positions over mid-epoch only) the epoch runs whole, in this run's order (whether that is
    the saved run's is not known); mid-epoch samples are replayed and skipped."""
    done, epoch = trainer.fit_loop.epoch_loop.batch_progress.current.ready, trainer.current_epoch
    why = "data order: the checkpoint holds no data position (saved without ByteCheckpointIO's data order)"
    if done == 0 or done >= len(loader):  # all batches done: Lightning goes on with the next epoch
        return Verdict(False, f"{why}; resumed at the start of epoch {epoch + (done > 0)}: it runs whole, in this run's order "
                              f"(seed {loader.elastic_sampler.seed}), which may not be the saved run's")
    return Verdict(False, f"{why}; Lightning counts {done} batches of epoch {epoch} as done but starts its loader "
                          f"from the first batch: some samples are trained twice, others never")


def _report(io_ref: Optional[weakref.ref], result: Verdict) -> None:
    io = io_ref() if io_ref is not None else None
    if io is not None:
        io.data_order_report = result.line
    (rank_zero_info if result.exact else rank_zero_warn)(result.line)


def _trainer_of(strategy: Any) -> Any:
    module = strategy.lightning_module
    try:
        return module.trainer if module is not None else None
    except RuntimeError:  # a module not attached to a Trainer (Fabric)
        return None


def process_train_loader(strategy: Any, dataloader: Any) -> Any:
    """The Trainer's train loader, made elastic and stateful; anything else passes through."""
    io = strategy.checkpoint_io
    if not isinstance(io, ByteCheckpointIO) or isinstance(dataloader, StatefulLoaderMixin):
        return dataloader
    trainer = _trainer_of(strategy)
    if trainer is None or trainer.state.stage != RunningStage.TRAINING:
        return dataloader
    if not io.data_order or not isinstance(dataloader, DataLoader):
        _drop_records(trainer)  # nothing takes them (nor is asked to)
        return dataloader
    kwargs, reason = _elastic_kwargs(dataloader, trainer)
    if reason is None:
        try:
            new = _compat.update_dataloader(dataloader, ElasticSampler(dataloader.dataset, **kwargs))
        except Exception as err:  # e.g. a DataLoader subclass Lightning cannot re-instantiate (one device)
            reason = f"{type(dataloader).__name__} could not be rebuilt with another sampler ({err})"
    if reason is not None:
        _drop_records(trainer)
        if trainer.ckpt_path is not None:
            _report(weakref.ref(io), Verdict(False, f"data order: not resharded: {reason}; Lightning starts the "
                                                    f"interrupted epoch's loader from its first batch"))
        return dataloader
    make_stateful(new, _LightningLoader)
    new._bcp_io, new._bcp_trainer = weakref.ref(io), weakref.ref(trainer)
    if not trainer.fit_loop.restarting:
        # At an epoch boundary Lightning hands no loader state over, but the saved order (its seed)
        # must still win over this run's PL_GLOBAL_SEED: the loaders take their records in order.
        states = _compat.pending_loader_states(trainer)
        mine = next((i for i, s in enumerate(states) if DataPosition.is_record(s)), None)
        if mine is not None:
            new.load_state_dict(states.pop(mine))
    return new


def _drop_records(trainer: Any) -> None:
    states = _compat.pending_loader_states(trainer)
    states[:] = [s for s in states if not DataPosition.is_record(s)]


def _elastic_kwargs(dataloader: DataLoader, trainer: Any) -> Tuple[Optional[dict], Optional[str]]:
    """ElasticSampler settings equal to the loader's sampler, or the reason there are none."""
    sampler = dataloader.sampler
    if isinstance(dataloader.dataset, IterableDataset):
        return None, "an IterableDataset has no reshardable position"
    if callable(getattr(dataloader, "state_dict", None)) and callable(getattr(dataloader, "load_state_dict", None)):
        # what Lightning's (private) _Stateful protocol checks before it saves a loader's state
        return None, (f"{type(dataloader).__name__} keeps its own per-process state (exact on the same process "
                      f"count only)")
    if dataloader.batch_sampler is None:
        return None, "the loader does not batch (batch_size=None)"
    if type(dataloader.batch_sampler) is not BatchSampler:
        return None, f"a custom batch_sampler ({type(dataloader.batch_sampler).__name__})"
    if type(sampler) is DistributedSampler:
        return dict(num_replicas=sampler.num_replicas, rank=sampler.rank, shuffle=sampler.shuffle, seed=sampler.seed,
                    drop_last=sampler.drop_last), None
    if type(sampler) in (RandomSampler, SequentialSampler) and trainer.world_size == 1:
        random = isinstance(sampler, RandomSampler)
        if random and (sampler.replacement or sampler.num_samples != len(sampler.data_source)):
            return None, "a RandomSampler with replacement or num_samples has no epoch order"
        # the order Lightning's DistributedSampler draws on more devices
        return dict(num_replicas=1, rank=0, shuffle=random, seed=int(os.getenv("PL_GLOBAL_SEED", 0))), None
    if type(sampler) in (RandomSampler, SequentialSampler):
        return None, "Trainer(use_distributed_sampler=False): every process draws its own order"
    return None, f"the sampler is a {type(sampler).__name__}"
