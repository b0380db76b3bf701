"""The caller's side of an async save: copy the state out into a staging slot, start the
background write, return once the copies have landed.

The copies start as early as they can: when the last plan of this process group is known (an
unchanged layout, the usual case), each tensor's writes are copied out as the walk over the state
finds it (saver.EarlyCopies), so device-to-host copies run while the rest of the state is walked
and planned; otherwise right after planning. The background thread starts while the copies are
in flight; save() then waits on one fence and returns (the sources may change afterwards).
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from . import saver
from .handles import SaveHandle
from .planner import LocalPlan
from .staging import StagingPool
from .workers import BackgroundRunner, Workers


def early_copies(pool: StagingPool, plans: saver.PlanCache, key: Any) -> Optional[saver.EarlyCopies]:
    """Copies that start during the walk, from the last plan of this process group (None on the
    first save: its plan is not known before the walk). Holds a staging slot: release it if the
    save fails before start()."""
    cached = plans.get(key)
    if cached is None:
        return None
    return saver.EarlyCopies(cached.local, pool.session(pool.acquire()))


def release(early: Optional[saver.EarlyCopies]) -> None:
    if early is not None:
        early.staging.pool.release(early.staging.slot)


def start(pool: StagingPool, runner: BackgroundRunner, threads: int, early: Optional[saver.EarlyCopies],
          local: LocalPlan, data: Sequence[torch.Tensor], start_background: Callable, handle: SaveHandle,
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
            staged = staging.stage([(saver.staging_key(w, t), t) for w, t in zip(local.writes, data)])
        fence = staging.fence()
        staging.finish()
        write, start_beat = start_background()
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
        yield pool.stage(slot, [(saver.staging_key(w, t), t) for w, t in zip(local.writes, data)])
    finally:
        pool.release(slot)
