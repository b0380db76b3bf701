"""Async staging's gate: which tensors an optimizer step changes (Guards), the step pre-hook that
holds a step until its tensors' copies landed (StepFence), and the check that nothing else changed
them meanwhile (Pending.land).

An async save with async staging copies, before save() returns, only what no optimizer in the
state guards (module buffers, plain tensors, small tensors): a forward may change those. The
tensors each optimizer holds (its parameters and its state: Adam's moments) change only in its
`step()`, so they are copied in the background while the next forward and backward run, and the
step waits for them: a global optimizer step pre-hook, the only fence (docs/async_staging.md).

The guard: every optimizer-held tensor's version counter is read when its copy is scheduled and
again when the copy has landed (for CUDA copies: when its optimizer's step passes the fence, after
which the step's own changes are stream-ordered behind the copy). A change means something wrote
it outside the step while its copy was pending: the save fails, naming the tensor, and is never
committed (a re-copy would mix moments: that tensor after the change, the rest before it).
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Callable, List, Optional, Sequence, Set, Tuple

import torch

from ..common.errors import CheckpointError
from .guards import Guard, Guarded, Holder, _hooked, _innermost, closure_first, version

log = logging.getLogger("bytecheckpoint")


# ---------------------------------------------------------------------------------- pending copies

class Pending:
    """One save's deferred copies: landed once every copy is in the staging slot and the guard
    checked. The fence holds its optimizers' steps until then. `items`: (write key, Guarded) per
    deferred write; `events`: (device, CUDA event) recorded after side-stream copies, when every
    deferred copy is one (a step then waits on the GPU, not on the CPU)."""

    def __init__(self, path: str, items: Sequence[Tuple[str, Guarded]], events: Sequence[Tuple[Any, Any]] = (),
                 on_wait: Optional[Callable[[float, float], None]] = None):
        self.path = path
        self.events = list(events)
        self._watch: List[Tuple[str, Guard, Holder, int]] = []   # (key, guard, holder, version at scheduling)
        seen: Set[int] = set()
        for key, entry in items:
            for h in entry.holders:
                if id(h.tensor) not in seen:
                    seen.add(id(h.tensor))
                    self._watch.append((key, entry.guard, h, version(h.tensor)))
        self.opt_ids: Set[int] = {i for _, entry in items for i in entry.guard.ids}
        self.passed: Set[int] = set()              # optimizers (id of the innermost) past the fence (CUDA)
        self.error: Optional[CheckpointError] = None
        self._landed = threading.Event()
        self._lock = threading.Lock()
        self.on_wait = on_wait                     # (start, end) of each step held for this save
        self.timeout_s = 600.0                     # how long a step waits (StepFence.add: Options.timeout_s)

    @property
    def landed(self) -> bool:
        return self._landed.is_set()

    def holds(self, opt: Any) -> bool:
        return not self._landed.is_set() and id(opt) in self.opt_ids

    def _check(self, where: str, only: Optional[Set[int]] = None) -> None:
        if self.error is not None:
            return
        for key, g, h, was in self._watch:
            if id(g.optimizer) in self.passed or (only is not None and id(g.optimizer) not in only):
                continue
            now = version(h.tensor)
            if now != was:
                self.error = _changed_error(self.path, key, g, h, was, now, where)
                return

    def land(self) -> None:
        """The copies are in the slot: check every optimizer's tensors not yet past the fence, then
        let steps go. Called on the job thread, exactly once (also after a failed copy)."""
        with self._lock:
            self._check("while its copy was pending")
            self._landed.set()
            self._watch = []  # nothing reads it once landed: do not keep the optimizer and its tensors alive
        _release(self)

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error if isinstance(error, CheckpointError) else CheckpointError(
                    f"async staging: copying the optimizers' tensors for {self.path!r} failed: {error}")
            self._landed.set()
            self._watch = []
        _release(self)

    def pass_fence(self, opt: Any) -> None:
        """The step of `opt` (the object the hook saw) may go: with GPU copies its stream waits for
        them (no CPU block); else the thread waits until they landed, at most timeout_s (then the save
        fails and no later step waits for it)."""
        t0 = time.perf_counter()
        if self.events:
            with self._lock:
                if self._landed.is_set():
                    return
                mine = {id(g.optimizer) for _, g, _, _ in self._watch if id(opt) in g.ids}
                self._check("before its optimizer's step", only=mine)
                self.passed.update(mine)
            for device, event in self.events:
                torch.cuda.current_stream(device).wait_event(event)
        elif not self._landed.wait(self.timeout_s):
            self.fail(CheckpointError(
                f"async staging: the copy for {self.path!r} did not land within {self.timeout_s:.0f} s (timeout_s); "
                f"the optimizer step went on and this save fails. Save with async_staging=False."))
        if self.on_wait is not None:
            self.on_wait(t0, time.perf_counter())

    def wait(self, timeout_s: Optional[float] = None) -> bool:
        return self._landed.wait(timeout_s)


def _changed_error(path: str, key: str, g: Guard, h: Holder, was: int, now: int, where: str) -> CheckpointError:
    return CheckpointError(
        f"async staging: {key!r} ({g.name} {h.what}, shape {tuple(h.tensor.shape)}) was changed in place (version "
        f"{was} -> {now}) {where}, outside {g.name}.step(). The checkpoint at {path!r} was not committed (the "
        f"previous one is intact): it would have mixed that tensor after the change with the rest before it. Change "
        f"it before save() or after the next step, or save with async_staging=False (e.g. bcp.Checkpointer("
        f"async_save=True, async_staging=False) or BCP_ASYNC_STAGING=0).")


# ---------------------------------------------------------------------------------- the fence
#
# torch iterates its global hook tables (OrderedDicts) on every step, on whatever thread steps: a hook
# registered or removed meanwhile, from another thread (a save from a checkpoint thread, close()) or
# from inside a hook, raises "OrderedDict mutated during iteration" in the training step. So the two
# global hooks below are registered once per process (when the first Checkpointer or warm-up trigger
# is made, at setup) and never removed; what they act on lives in immutable tuples here, replaced
# under _LOCK, which the hooks read without a lock. With nothing pending a step pays one Python call.

_LOCK = threading.Lock()
_INSTALLED = False
_HELD: Tuple[Pending, ...] = ()                # every Pending not landed yet, of every fence
_FENCES: "weakref.WeakSet[StepFence]" = weakref.WeakSet()  # one per open Checkpointer (under _LOCK)
_TRIGGERS: Tuple["AfterFirstSteps", ...] = ()  # armed warm-up triggers


def _install() -> None:
    """Register the global step pre-hook (the fence) and post-hook (warm-up triggers), once."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        register_optimizer_step_pre_hook(_step_pre_hook)
        register_optimizer_step_post_hook(_step_post_hook)
        _INSTALLED = True


def hook_installed() -> bool:
    return _INSTALLED


def _hold(pending: Pending) -> None:
    global _HELD
    with _LOCK:
        _HELD = tuple(p for p in _HELD if not p.landed) + (pending,)


def _release(pending: Pending) -> None:
    global _HELD
    with _LOCK:
        _HELD = tuple(p for p in _HELD if p is not pending and not p.landed)
        fences = list(_FENCES)  # iterated under the lock: another thread may add one meanwhile
    for fence in fences:
        fence.pending()  # prunes the landed ones: a landed save holds no reference to the training state


def drain_every(timeout_s: float) -> None:
    """Wait until every pending copy of this process landed, whichever Checkpointer made it: a load
    into the live tensors by any engine writes their memory without moving torch's version counters,
    so the guard of another engine's save would not see it."""
    for p in _HELD:
        if not p.wait(timeout_s):
            p.fail(CheckpointError(f"async staging: the copy for {p.path!r} did not land within "
                                   f"{timeout_s:.0f} s (timeout_s)"))


class StepFence:
    """One Checkpointer's pending copies (load(), restore() and close() drain them). The steps are
    held by the process's one global step pre-hook, which looks at every fence's pending copies."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._pending: List[Pending] = []
        self._lock = threading.Lock()
        _install()  # at setup, not from a save that may run beside a step on another thread
        with _LOCK:
            _FENCES.add(self)  # open now: the first save made inside step(closure) must hold that update too

    def add(self, pending: Pending) -> None:
        pending.timeout_s = self.timeout_s
        with self._lock:
            self._pending = [p for p in self._pending if not p.landed] + [pending]
        _hold(pending)

    def pending(self) -> List[Pending]:
        with self._lock:
            self._pending = [p for p in self._pending if not p.landed]
            return list(self._pending)

    def drain(self) -> None:
        """Wait until every pending copy landed (before a load into the live tensors, at close)."""
        for p in self.pending():
            if not p.wait(self.timeout_s):
                p.fail(CheckpointError(f"async staging: the copy for {p.path!r} did not land within "
                                       f"{self.timeout_s:.0f} s (timeout_s)"))

    def close(self) -> None:
        self.drain()
        with _LOCK:
            _FENCES.discard(self)


def _wait_for(opt: Any) -> None:
    """Hold `opt`'s step until the copies of its tensors landed (every save's, read now)."""
    for p in _HELD:
        if p.holds(opt):
            p.pass_fence(opt)


def _step_pre_hook(opt: Any, args: tuple, kwargs: dict):
    """torch calls this before every Optimizer.step (args[0] is the optimizer itself)."""
    if not _HELD and not _FENCES:  # nothing pending and no Checkpointer open: the per-step cost
        return None
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None:
        _wait_for(opt)
        return None
    if not closure_first(opt):
        _wait_for(opt)  # it may change its tensors before calling the closure
    # Lightning runs training_step + backward inside step(closure): wait after the closure (the
    # forward and backward overlap the copy), before the update; the pending copies are read then, so
    # a save made inside the closure (a checkpoint from training_step) holds this update too.
    ran: List[bool] = []

    def fenced_closure(*a: Any, **kw: Any) -> Any:
        out = closure(*a, **kw)
        if not ran:
            ran.append(True)
            _wait_for(opt)
        return out
    if "closure" in kwargs:
        return args, {**kwargs, "closure": fenced_closure}
    return (args[0], fenced_closure, *args[2:]), kwargs


def _step_post_hook(opt: Any, args: tuple, kwargs: dict) -> None:
    for trigger in _TRIGGERS:
        trigger._post(opt)


def cuda_capturing() -> bool:
    """A CUDA graph is being captured: its replays run no Python hooks, so nothing may be deferred."""
    try:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except RuntimeError:
        return False


# ---------------------------------------------------------------------------------- warm-up trigger

class AfterFirstSteps:
    """Calls `fn(owner)` once, right after each optimizer of `optimizers(owner)` (read at every step:
    frameworks create them late) has stepped once: the moment the state exists in full (Adam's moments
    are made by the first step), for the adapters' automatic warm_up. A GradScaler-skipped step does
    not count (no step ran). `fn` failing is logged, never raised into the training step. `owner` is
    held weakly: once it is gone, or `optimizers` returns None, or none of the optimizers it lists
    reaches torch's step hooks (it would never fire), the trigger disarms; remove() disarms it too.
    `result`: what `fn` returned unless None (the adapters' warm-up Future); the given `result` until."""

    def __init__(self, optimizers: Callable[[Any], Optional[Sequence[Any]]], fn: Callable[[Any], Any],
                 owner: Any, result: Any = None):
        global _TRIGGERS
        self._optimizers, self._fn, self.result = optimizers, fn, result
        self._owner = weakref.ref(owner)
        self._stepped: Set[int] = set()
        _install()
        with _LOCK:
            _TRIGGERS = _TRIGGERS + (self,)

    @property
    def armed(self) -> bool:
        return self in _TRIGGERS

    def remove(self) -> None:
        global _TRIGGERS
        with _LOCK:
            _TRIGGERS = tuple(t for t in _TRIGGERS if t is not self)

    def _post(self, opt: Any) -> None:
        owner = self._owner()
        listed = self._optimizers(owner) if owner is not None else None
        if listed is None:  # the owner is gone: disarm
            self.remove()
            return
        wanted = [o for o in (_innermost(o)[0] for o in listed if isinstance(o, torch.optim.Optimizer)) if _hooked(o)]
        if not wanted:
            if listed:  # e.g. a wrapper of DeepSpeed's ZeRO optimizer: its step runs no global hook
                self.remove()
            return
        if not any(w is opt for w in wanted):
            return
        self._stepped.add(id(opt))
        if not all(id(w) in self._stepped for w in wanted):
            return
        self.remove()
        try:
            out = self._fn(owner)
            if out is not None:  # None: nothing started (e.g. a sync engine)
                self.result = out
        except Exception as exc:  # noqa: BLE001 - a warm-up never breaks training; the first save allocates
            log.warning("bytecheckpoint: the automatic staging warm-up failed (the first async save will allocate "
                        "its buffers instead): %s", exc)
