"""The prepared loaders' global order, saved with every ``save_state`` and resumed on any
process count (issue 32; docs/data.md, docs/accelerate.md "Data order").

Accelerate deals whole batches of one global order to the processes (``BatchSamplerShard``: global
step k is positions ``[k*G, (k+1)*G)`` of that order on every process count), so what must
survive a resume is the *order*: each prepared loader's sampler is adopted right after
``prepare`` built it:

* ``SeedableRandomSampler`` (``use_seedable_sampler=True``) -> ``SeededOrder``: the same order, with
  an epoch that never goes back to a stale value (after a resume the user's
  ``skip_first_batches`` loader runs the interrupted epoch while the prepared loader's epoch
  counter stays behind: stock Accelerate then replays that epoch's order for the next one).
* ``RandomSampler`` (the default) -> ``GeneratorOrder``: the generator's state at the start of each
  epoch is recorded. On one process Accelerate leaves the sampler drawing from the global RNG
  (an order unrelated to the multi-process one); it gets a generator seeded exactly as
  ``prepare_data_loader`` seeds it on 2+ processes (one draw from the global RNG, at the same point).
* ``SequentialSampler``: nothing to change (the epoch is restored).

With the order restored, the user's ``skip_first_batches(dl, k)`` (k completed steps) or
Accelerate's stateful loader (``use_stateful_dataloader``) lands exactly where the saved run was.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional

import torch
from accelerate.data_loader import DataLoaderShard, SeedableRandomSampler
from bytecheckpoint.data import DataPosition, GeneratorOrder, SeededOrder, keep_hint
from bytecheckpoint.state.flatten import top_level_placeholders
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, SequentialSampler

from . import _compat as compat

logger = logging.getLogger(__name__)

KEY = "data"  # the top-level key of the bytecheckpoint state


def global_sampler(dl: Any) -> Any:
    """The sampler of the global order: inside ``BatchSamplerShard`` on 2+ processes (where
    ``accelerate.data_loader.get_sampler`` finds nothing), inside the plain ``BatchSampler`` on one."""
    bs = dl.sampler if isinstance(dl.sampler, BatchSampler) else dl.batch_sampler
    return getattr(getattr(bs, "batch_sampler", bs), "sampler", None)


def unsupported(dl: Any) -> Optional[str]:
    """Why ``dl``'s order is not reshardable (None: it is)."""
    if not isinstance(dl, DataLoaderShard):
        return f"a {type(dl).__name__} (dispatch_batches) is not adopted"
    if isinstance(dl.dataset, IterableDataset):
        return "an IterableDataset has no reshardable position"
    sampler = global_sampler(dl)
    if isinstance(sampler, (SeededOrder, GeneratorOrder, SequentialSampler)):
        return None
    if type(sampler) is RandomSampler or isinstance(sampler, SeedableRandomSampler):
        if sampler.replacement or sampler.num_samples != len(sampler.data_source):
            # an epoch is not one permutation of the dataset: the global orders cannot stand in for it
            return f"a {type(sampler).__name__} with replacement or num_samples has no epoch order"
        return None
    return f"the sampler is a {type(sampler).__name__}"


def adopt(dl: Any) -> None:
    """Give a prepared loader its global order (idempotent; an unsupported one is left alone)."""
    if unsupported(dl) is not None:
        return
    sampler = global_sampler(dl)
    if isinstance(sampler, SeedableRandomSampler):
        dl.set_sampler(SeededOrder(sampler.data_source, sampler.initial_seed, epoch=sampler.epoch))
    elif type(sampler) is RandomSampler:
        if sampler.generator is None:  # one process: seeded as prepare_data_loader seeds it on 2+
            sampler.generator = torch.Generator()
            sampler.generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
            dl.synchronized_generator = sampler.generator
        dl.set_sampler(GeneratorOrder(sampler))


def record(dl: Any, world: int) -> Dict[str, Any]:
    reason = unsupported(dl)
    if reason is not None:
        return {"unsupported": reason}
    sampler, g = global_sampler(dl), dl.total_batch_size
    if isinstance(sampler, (SeededOrder, GeneratorOrder)):
        return sampler.position(g, world).to_state()
    return DataPosition(epoch=int(dl.iteration), consumed=None, dataset_len=len(dl.dataset), global_batch=g,
                        shuffle=False, world_size=world).to_state()


def restore(dl: Any, saved: Dict[str, Any], world: int) -> str:
    """Restore one loader's order; returns the line the resume reports."""
    reason = saved.get("unsupported") if isinstance(saved, dict) else "no record"
    reason = reason or unsupported(dl)
    if reason is not None:
        return f"data order: not resharded: {reason}; the loader starts its order anew"
    pos, sampler = DataPosition.from_state(saved), global_sampler(dl)
    n, g = len(dl.dataset), dl.total_batch_size
    kind = "seeded" if pos.seed is not None else "generator" if pos.generator_state is not None else "sequential"
    mine = ("seeded" if isinstance(sampler, SeededOrder) else "generator" if isinstance(sampler, GeneratorOrder)
            else "sequential")
    if pos.dataset_len != n:
        return (f"data order: not exact: the dataset has {n} samples, the checkpoint's had {pos.dataset_len}; the "
                f"loader starts its order anew")
    if kind != mine:
        return (f"data order: not exact: the checkpoint's order is {kind}, this loader's is {mine} "
                f"(use_seedable_sampler changed?); the loader starts its order anew")
    if mine != "sequential":
        sampler.restore(pos)
    dl.set_epoch(pos.epoch)
    if pos.global_batch != g:
        return (f"data order: not step for step: global batch {pos.global_batch} -> {g}; epoch {pos.epoch}'s order "
                f"is restored, but skip_first_batches(dl, k) counts batches of {g}: skip the samples already trained "
                f"divided by {g} to continue by sample count; {keep_hint(pos.global_batch, world)}")
    return (f"data order: exact (epoch {pos.epoch}'s order restored, {pos.world_size} -> {world} processes, global "
            f"batch {g}): skipping the completed steps continues step for step")


class _Records:
    """The ``data`` entry of the state: every prepared loader's record (Accelerate's order of
    ``accelerator._dataloaders``); a stateful object, so the engine hands the saved value back."""

    def __init__(self, attachment: "DataOrderMixin") -> None:
        self._attachment = attachment

    def state_dict(self) -> Dict[str, Any]:
        acc = self._attachment.accelerator
        return {"loaders": [record(dl, acc.num_processes) for dl in compat.dataloaders(acc)]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        acc = self._attachment.accelerator
        loaders, saved = compat.dataloaders(acc), list(state.get("loaders", []))
        lines = []
        for i, dl in enumerate(loaders):
            line = restore(dl, saved[i], acc.num_processes) if i < len(saved) else \
                "data order: not resharded: the checkpoint holds no record for this loader"
            lines.append(line if len(loaders) == 1 else f"loader {i}: {line}")
        self._attachment._data_report(lines)


class DataOrderMixin:
    """The data-order part of ``ByteCheckpointAttachment`` (kept here; _attach.py only calls it)."""

    _data_enabled = False
    #: the lines the last load reported, one per prepared loader (None before a load)
    data_order: Optional[List[str]] = None

    def _data_setup(self, enabled: bool) -> None:
        self._data_enabled = bool(enabled)
        if self._data_enabled:
            for dl in compat.dataloaders(self.accelerator):
                adopt(dl)

    def _wrapped_prepare_data_loader(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        dl = original(*args, **kwargs)
        if self._active and self._data_enabled:
            adopt(dl)
        return dl

    def _with_data(self, state: Dict[str, Any], path: Optional[str] = None) -> Dict[str, Any]:
        """``state`` plus the loaders' records; for a load from ``path``, only when the
        checkpoint holds them (a checkpoint from before, or without data order, does not)."""
        if path is not None:
            saved = KEY in top_level_placeholders(self._ckpt.metadata(path, **self._storage).structure)
            if not saved:
                if self._data_enabled:
                    self._data_report(["data order: the checkpoint holds no data position (saved without attach's "
                                       "data order); the loaders start their orders anew"])
                return state
            if not self._data_enabled:
                state[KEY] = None  # read and dropped (a strict load wants every saved key)
                return state
        if self._data_enabled:
            state[KEY] = _Records(self)
        return state

    def _data_report(self, lines: List[str]) -> None:
        self.data_order = lines
        if self.accelerator.is_main_process:
            for line in lines:
                logger.log(logging.INFO if line.startswith("data order: exact") else logging.WARNING, line)
