"""Staging: the state's bytes copied out of the training tensors into a reusable staging slot,
so an async save's caller can return (the sources may change afterwards) and a sync save's GPU
tensors reach the host at the copy engines' speed.

The copies start as early as they can: when the last plan of this process group is known (an
unchanged layout, the usual case), each tensor's writes are copied out as the walk over the state
finds it (EarlyCopies), so device-to-host copies run while the rest of the state is walked and
planned; otherwise right after planning. The background thread starts while the copies are in
flight; save() then waits on one fence and returns.

Async staging (a Deferral, pipeline/gate.py): the writes whose memory only an optimizer's step
changes are not copied before save() returns; the job thread copies them first thing (CPU: one
thread, memmove), or a side CUDA stream does (queued here, after the current stream's work), and
the optimizer's next step waits for them (the fence). A tensor changed meanwhile outside the step
fails the save (Torn): it is never committed.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..monitor import OFF, Recorder
from ..planning.planner import LocalPlan, WriteItem
from ..state.flatten import TensorEntry
from . import gate, guards
from .handles import SaveHandle
from .save_plan import PlanCache
from .staging import StagingPool, copy_cpu
from .workers import BackgroundRunner, Workers
from .write import Written, source_of


@dataclass
class Deferral:
    """Async staging of one save: the guards of the state's optimizers and the Checkpointer's fence.
    `cpu`: CPU sources are deferred too (async_staging=True), not only CUDA ones ("auto")."""
    guards: guards.Guards
    fence: gate.StepFence
    cpu: bool

    def of(self, src: torch.Tensor) -> Optional[guards.Guarded]:
        if not (src.is_cuda or (self.cpu and src.device.type == "cpu")):
            return None
        return self.guards.of(src)


def staging_key(w: WriteItem, t: torch.Tensor) -> tuple:
    return (w.key, w.offsets, w.lengths, t.dtype)


def staging_items(local: LocalPlan, data: Sequence[torch.Tensor]) -> List[tuple]:
    return [(staging_key(w, t), t) for w, t in zip(local.writes, data)]


class EarlyCopies:
    """An async save's staging copies started while the state is still being walked: when the
    last plan for this process group is known, each tensor's writes are copied out the moment the
    walk finds it, so the copy engines run during the rest of the walk and the planning. Used only
    if the save's plan turns out to be that same plan (an unchanged layout: the usual case)."""

    def __init__(self, plan: LocalPlan, staging, deferral: Optional[Deferral] = None) -> None:
        self.plan, self.staging, self.deferral = plan, staging, deferral
        self._by_key: Dict[str, List[int]] = {}
        for i, w in enumerate(plan.writes):
            self._by_key.setdefault(w.key, []).append(i)
        self._buffers: Dict[int, Optional[torch.Tensor]] = {}  # None: deferred (async staging)
        self.first_copy: Optional[float] = None  # perf_counter of the first copy (SaveHandle.stats)

    def on_tensor(self, entry: TensorEntry) -> None:
        if self.first_copy is None:
            self.first_copy = time.perf_counter()
        for i in self._by_key.get(entry.key, ()):
            w = self.plan.writes[i]
            src = source_of(entry, w)
            if src is not None and src.dtype == entry.dtype and tuple(src.shape) == tuple(w.lengths):
                deferred = self.deferral is not None and self.deferral.of(src) is not None
                self._buffers[i] = None if deferred else self.staging.copy(staging_key(w, src), src)

    def buffers(self, local: LocalPlan) -> Optional[List[Optional[torch.Tensor]]]:
        """The staged buffers of every write of `local` (None where deferred), or None unless it is
        the plan copied from."""
        if local is not self.plan or len(self._buffers) != len(local.writes):
            return None
        return [self._buffers[i] for i in range(len(local.writes))]


def early_copies(pool: StagingPool, plans: PlanCache, key: Any,
                 deferral: Optional[Deferral] = None) -> Optional[EarlyCopies]:
    """Copies that start during the walk, from the last plan of this process group (None on the
    first save: its plan is not known before the walk). Holds a staging slot: release it if the
    save fails before start()."""
    cached = plans.get(key)
    if cached is None:
        return None
    return EarlyCopies(cached.local, pool.session(pool.acquire()), deferral)


def release(early: Optional[EarlyCopies]) -> None:
    if early is not None:
        early.staging.pool.release(early.staging.slot)


class Torn(Sequence):
    """The staged data of a save whose deferred copy was torn (a guarded tensor changed outside its
    optimizer's step) or failed: every use raises the error, inside the target's own error path, so
    the save fails on every rank and nothing is committed."""

    def __init__(self, error: BaseException):
        self.error = error

    def __len__(self) -> int:
        raise self.error

    def __getitem__(self, i):
        raise self.error

    def __iter__(self):
        raise self.error


_SIDE: Dict[Any, Any] = {}
_SIDE_LOCK = threading.Lock()


def _side_stream(device: torch.device):
    with _SIDE_LOCK:
        if device not in _SIDE:
            _SIDE[device] = torch.cuda.Stream(device)
        return _SIDE[device]


def _queue_side_copies(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> List[Tuple[Any, Any]]:
    """Device-to-host copies of (buffer, source) on a side stream per device, after the work the
    current stream has queued (the state as save() sees it); one event per device after them."""
    by_device: Dict[torch.device, list] = {}
    for buf, src in pairs:
        by_device.setdefault(src.device, []).append((buf, src))
    events = []
    for device, items in by_device.items():
        stream = _side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for buf, src in items:
                buf.copy_(src, non_blocking=True)
                src.record_stream(stream)  # a block freed meanwhile is not handed out before this copy ran
        event = torch.cuda.Event()
        event.record(stream)
        events.append((device, event))
    return events


def copy_deferred(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The deferred CPU copies (buffer, source), on the job thread (tests delay it to widen the window)."""
    for buf, src in pairs:
        copy_cpu(buf, src)


def start(pool: StagingPool, runner: BackgroundRunner, threads: int, early: Optional[EarlyCopies],
          local: LocalPlan, data: Sequence[torch.Tensor], written: Written, handle: SaveHandle,
          closed: Callable[[], bool], t0: float, deferral: Optional[Deferral] = None,
          rec: Recorder = OFF) -> None:
    """Stage `data` (the sources of `local`'s writes), start the background write on `runner`,
    wait for the copies; fills handle._future and handle.stats. With `deferral` (async staging) the
    guarded writes are copied in the background and their optimizers' steps wait for them."""
    staging = early.staging if early is not None else pool.session(pool.acquire())
    slot = staging.slot
    items = staging_items(local, data)
    gpu_events: List[Any] = []
    try:
        t_copy = time.perf_counter()
        early_bufs = early.buffers(local) if early is not None else None
        handle.stats["copies_started_early"] = early_bufs is not None
        staged: List[Optional[torch.Tensor]] = list(early_bufs) if early_bufs is not None else [None] * len(items)
        guarded = [None if staged[i] is not None or deferral is None else deferral.of(src)
                   for i, (_, src) in enumerate(items)]
        deferred = [i for i, g in enumerate(guarded) if g is not None]
        # missing buffers: one arena (a warm_up or an earlier save of this layout allocated them already)
        handle.stats["allocated_bytes"] = pool.reserve(slot, [items[i] for i, b in enumerate(staged) if b is None])
        for i, (k, src) in enumerate(items):
            if staged[i] is None:
                staged[i] = staging.reserve([(k, src)])[0] if guarded[i] is not None else staging.copy(k, src)
        fence = staging.fence()
        staging.finish()
        pending, cpu_pairs, gpu_events = _defer(deferral, handle, rec, local, items, staged, guarded, deferred)
        write, start_beat = written.start_background()
    except BaseException:
        for _, event in gpu_events:
            event.synchronize()  # side-stream copies queued into the slot finish before it is reused
        pool.release(slot)
        raise
    if pending is not None:
        deferral.fence.add(pending)  # before save() returns: the next step is held

    # One thread start on the caller's thread (each costs a scheduler round trip: measured up to
    # ~60 ms on a loaded machine); the heartbeat and the pre-faulting job start from it.
    def run(wait_turn) -> None:
        beat = None
        cpu0 = time.thread_time()
        try:  # from here on, whatever fails releases the steps held for this save (finally)
            beat = start_beat() if start_beat is not None else None  # peers can tell this rank is alive
            out: Sequence[torch.Tensor] = staged  # type: ignore[assignment]
            if pending is not None:
                out = _land(pending, cpu_pairs, gpu_events, staged, handle, rec)
            fence.wait()  # the staging copies have landed
            wait_turn()  # after the previous save's job (beating meanwhile: a slow one is not a dead one)
            with Workers(threads) as workers:
                try:
                    write(workers, out)
                finally:
                    handle.stats["background_cpu_s"] = time.thread_time() - cpu0 + workers.cpu_s
        finally:
            if pending is not None and not pending.landed:
                pending.fail(RuntimeError("the save's background job ended before its copies landed"))
            if beat is not None:
                beat.stop()
            pool.release(slot)
        if not closed():  # pre-fault the other slot before this save counts as done, so a save
            pool.warm(slot)  # right after wait() copies into warm pages (a no-op once both slots are)

    try:
        handle._future = runner.submit(run)
    except BaseException as exc:  # no thread: the steps must not wait for copies nobody makes
        if pending is not None:
            pending.fail(exc)
        pool.release(slot)
        raise
    t_wait = time.perf_counter()
    if deferral is None or not any(t.is_cuda for t in data):
        fence.wait()  # the sources may change once save() returns: their bytes must be out
    # else (async staging, GPU sources): the copies are queued on the current streams, before
    # whatever the training queues next there; the job waits for them before it reads the buffers
    done = time.perf_counter()
    handle.stats.update(copy_s=t_wait - t_copy, copy_wait_s=done - t_wait, stall_s=done - t0)
    if early is not None and early.first_copy is not None:
        handle.stats["first_copy_s"] = early.first_copy - t0


def _defer(deferral: Optional[Deferral], handle: SaveHandle, rec: Recorder, local: LocalPlan, items, staged,
           guarded, deferred: List[int]):
    """The Pending of this save's deferred copies (GPU ones queued now), its CPU pairs, GPU events."""
    stats = handle.stats
    now_bytes = sum(guards.nbytes(src) for i, (_, src) in enumerate(items) if guarded[i] is None)
    later_bytes = sum(guards.nbytes(items[i][1]) for i in deferred)
    stats.update(async_staging=deferral is not None, copied_now_bytes=now_bytes, deferred_bytes=later_bytes)
    if deferral is not None:
        stats["guarded_optimizers"] = deferral.guards.optimizers
        rec.set(async_staging=True, deferred_bytes=later_bytes)
    if not deferred:
        return None, [], []
    cpu_pairs = [(staged[i], items[i][1]) for i in deferred if not items[i][1].is_cuda]
    gpu_pairs = [(staged[i], items[i][1]) for i in deferred if items[i][1].is_cuda]

    def on_wait(t0: float, t1: float) -> None:  # a step held for this save (the training thread)
        stats["fence_wait_s"] = stats.get("fence_wait_s", 0.0) + (t1 - t0)
        if not rec.done:
            rec.add("copy.fence", t0, t1)
    # versions are read here, before any deferred copy starts
    pending = gate.Pending(handle.path, [(local.writes[i].key, guarded[i]) for i in deferred], on_wait=on_wait)
    gpu_events = _queue_side_copies(gpu_pairs) if gpu_pairs else []
    if not cpu_pairs:
        pending.events = gpu_events  # a step then waits on its stream, not on the CPU
    stats["fence_wait_s"] = 0.0
    return pending, cpu_pairs, gpu_events


def _land(pending: gate.Pending, cpu_pairs, gpu_events, staged, handle: SaveHandle, rec: Recorder):
    """On the job thread: the deferred copies, then the guard; the data to write (Torn if it failed)."""
    t = time.perf_counter()
    try:
        copy_deferred(cpu_pairs)
        for _, event in gpu_events:
            event.synchronize()
    except BaseException as exc:  # noqa: BLE001 - the save fails; steps must not wait forever
        pending.fail(exc)
    else:
        pending.land()
    t1 = time.perf_counter()
    nbytes = sum(guards.nbytes(b) for b, _ in cpu_pairs)
    rec.add("copy.deferred", t, t1, nbytes, len(cpu_pairs))
    handle.stats["deferred_copy_s"] = t1 - t
    if pending.error is not None:
        return Torn(pending.error)
    return staged


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
