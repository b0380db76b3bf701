"""Staging: the state's bytes copied out of the training tensors into a reusable staging slot,
so an async save's caller can return (the sources may change afterwards) and a sync save's GPU
tensors reach the host at the copy engines' speed.

The copies start as early as they can: when the last plan of this process group is known (an
unchanged layout, the usual case), each tensor's writes are copied out as the walk over the state
finds it (EarlyCopies), so device-to-host copies run while the rest of the state is walked and
planned; otherwise right after planning. The background thread starts while the copies are in
flight; save() then waits on one fence and returns.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from ..planning.planner import LocalPlan, WriteItem
from ..state.flatten import TensorEntry
from .handles import SaveHandle
from .save_plan import PlanCache
from .staging import StagingPool
from .workers import BackgroundRunner, Workers
from .write import Written, source_of


def staging_key(w: WriteItem, t: torch.Tensor) -> tuple:
    return (w.key, w.offsets, w.lengths, t.dtype)


def staging_items(local: LocalPlan, data: Sequence[torch.Tensor]) -> List[tuple]:
    return [(staging_key(w, t), t) for w, t in zip(local.writes, data)]


class EarlyCopies:
    """An async save's staging copies started while the state is still being walked: when the
    last plan for this process group is known, each tensor's writes are copied out the moment the
    walk finds it, so the copy engines run during the rest of the walk and the planning. Used only
    if the save's plan turns out to be that same plan (an unchanged layout: the usual case)."""

    def __init__(self, plan: LocalPlan, staging) -> None:
        self.plan, self.staging = plan, staging
        self._by_key: Dict[str, List[int]] = {}
        for i, w in enumerate(plan.writes):
            self._by_key.setdefault(w.key, []).append(i)
        self._buffers: Dict[int, torch.Tensor] = {}
        self.first_copy: Optional[float] = None  # perf_counter of the first copy (SaveHandle.stats)

    def on_tensor(self, entry: TensorEntry) -> None:
        if self.first_copy is None:
            self.first_copy = time.perf_counter()
        for i in self._by_key.get(entry.key, ()):
            w = self.plan.writes[i]
            src = source_of(entry, w)
            if src is not None and src.dtype == entry.dtype and tuple(src.shape) == tuple(w.lengths):
                self._buffers[i] = self.staging.copy(staging_key(w, src), src)

    def buffers(self, local: LocalPlan) -> Optional[List[torch.Tensor]]:
        """The staged buffers of every write of `local`, or None unless it is the plan copied from."""
        if local is not self.plan or len(self._buffers) != len(local.writes):
            return None
        return [self._buffers[i] for i in range(len(local.writes))]


def early_copies(pool: StagingPool, plans: PlanCache, key: Any) -> Optional[EarlyCopies]:
    """Copies that start during the walk, from the last plan of this process group (None on the
    first save: its plan is not known before the walk). Holds a staging slot: release it if the
    save fails before start()."""
    cached = plans.get(key)
    if cached is None:
        return None
    return EarlyCopies(cached.local, pool.session(pool.acquire()))


def release(early: Optional[EarlyCopies]) -> None:
    if early is not None:
        early.staging.pool.release(early.staging.slot)


def start(pool: StagingPool, runner: BackgroundRunner, threads: int, early: Optional[EarlyCopies],
          local: LocalPlan, data: Sequence[torch.Tensor], written: Written, handle: SaveHandle,
          closed: Callable[[], bool], t0: float) -> None:
    """Stage `data` (the sources of `local`'s writes), start the background write on `runner`,
    wait for the copies; fills handle._future and handle.stats."""
    staging = early.staging if early is not None else pool.session(pool.acquire())
    slot = staging.slot
    try:
        t_copy = time.perf_counter()
        staged = early.buffers(local) if early is not None else None
        handle.stats["copies_started_early"] = staged is not None
        if staged is None:
            staged = staging.stage(staging_items(local, data))
        fence = staging.fence()
        staging.finish()
        write, start_beat = written.start_background()
    except BaseException:
        pool.release(slot)
        raise

    # One thread start on the caller's thread (each costs a scheduler round trip: measured up to
    # ~60 ms on a loaded machine); the heartbeat and the pre-faulting job start from it.
    def run(wait_turn) -> None:
        beat = start_beat() if start_beat is not None else None  # peers can tell this rank is alive
        try:
            fence.wait()  # the staging copies have landed
            wait_turn()  # after the previous save's job (beating meanwhile: a slow one is not a dead one)
            with Workers(threads) as workers:
                write(workers, staged)
        finally:
            if beat is not None:
                beat.stop()
            pool.release(slot)
        if not closed():  # pre-fault the other slot before this save counts as done, so a save
            pool.warm(slot)  # right after wait() copies into warm pages (a no-op once both slots are)

    handle._future = runner.submit(run)
    t_wait = time.perf_counter()
    fence.wait()  # the sources may change once save() returns: their bytes must be out
    done = time.perf_counter()
    handle.stats.update(copy_s=t_wait - t_copy, copy_wait_s=done - t_wait, stall_s=done - t0)
    if early is not None and early.first_copy is not None:
        handle.stats["first_copy_s"] = early.first_copy - t0


@contextlib.contextmanager
def on_host(pool: StagingPool, local: LocalPlan, data: Sequence[torch.Tensor]) -> Iterator[Sequence[torch.Tensor]]:
    """A sync save's sources on the host: device tensors go through a staging slot (pinned, one
    fence, at the copy engines' speed) instead of one pageable, blocking copy per tensor while
    the chunks are encoded. Host-only state is written from where it is."""
    if not any(t.is_cuda for t in data):
        yield data
        return
    slot = pool.acquire()
    try:
        yield pool.stage(slot, staging_items(local, data))
    finally:
        pool.release(slot)
