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
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from ..common.errors import CheckpointError
from ..state.flatten import each_leaf

log = logging.getLogger("bytecheckpoint")

# Sources smaller than this are copied before save() returns (biases, scalars, `step` counters):
# cheaper to copy than to track.
SMALL_BYTES = 64 << 10
# Optimizers that update parameters inside backward (no step to hold): their tensors are copied now.
_UPDATE_IN_BACKWARD = ("Lomo", "AdaLomo")

StorageKey = Tuple[str, int]


def storage_key(t: torch.Tensor) -> Optional[StorageKey]:
    """(device, address) of the memory a tensor lives in (a DTensor: its local tensor's), or None
    when it has none we can name (meta, empty, a tensor subclass without storage)."""
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        t = local
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None
    return (str(t.device), ptr) if ptr else None


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------------- guards

@dataclass
class Holder:
    """An optimizer-held tensor (a parameter as in param_groups, a state tensor as in .state; for a
    DTensor the DTensor: its version counter is the one its step and in-place edits move)."""
    tensor: torch.Tensor
    what: str                      # "parameter" or "state 'exp_avg'"


@dataclass(eq=False)
class Guard:
    """An optimizer whose step is the only writer of some storages."""
    optimizer: torch.optim.Optimizer
    ids: Tuple[int, ...]           # ids of the optimizer and every wrapper found around it

    @property
    def name(self) -> str:
        return type(self.optimizer).__name__


@dataclass
class Guarded:
    """One storage's guard and the optimizer's tensors on it (what the guard's versions watch)."""
    guard: Guard
    holders: List[Holder] = field(default_factory=list)


def _innermost(opt: Any) -> Tuple[Any, Tuple[int, ...]]:
    """A torch optimizer and the ids of it and every torch-optimizer wrapper around it (Accelerate's
    AcceleratedOptimizer keeps the real one in `.optimizer`, Lightning's LightningOptimizer in
    `._optimizer`): the step hook sees the innermost one."""
    ids = [id(opt)]
    for _ in range(8):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            inner = getattr(opt, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is opt:
            break
        opt = inner
        ids.append(id(opt))
    return opt, tuple(ids)


def _hooked(opt: Any) -> bool:
    """Its step() runs torch's global step hooks (Optimizer.__init__ wraps the class's step): only
    then can the fence hold it. A wrapper that never called Optimizer.__init__ around something else
    (Accelerate's around DeepSpeed's ZeRO optimizer, whose engine steps an inner one) is not held."""
    return bool(getattr(type(opt).step, "hooked", False))


def optimizers_in(state: Any, extra: Iterable[Any] = ()) -> List[Tuple[Any, Tuple[int, ...]]]:
    """The optimizers found in `state` (its dicts, lists and tuples, as the walk finds parameter
    owners) and in `extra` (save(optimizers=...)), unwrapped, each once; only those whose step the
    fence can hold (anything else is copied before save() returns)."""
    found: Dict[int, Tuple[Any, Tuple[int, ...]]] = {}

    def add(v: Any) -> None:
        if not isinstance(v, torch.optim.Optimizer):  # e.g. DeepSpeed's ZeRO optimizer: not deferred
            return
        opt, ids = _innermost(v)
        if not _hooked(opt):
            return
        old = found.get(id(opt))
        found[id(opt)] = (opt, tuple(dict.fromkeys((old[1] if old else ()) + ids)))

    each_leaf(state, add)
    for v in extra:
        add(getattr(v, "_optimizer", v) if not isinstance(v, torch.optim.Optimizer) else v)
    return list(found.values())


class Guards:
    """storage -> the one optimizer that holds tensors there and those tensors. A storage held by two
    optimizers, or by parameters updated in backward, is nobody's: copied before save() returns."""

    def __init__(self, optimizers: Sequence[Tuple[Any, Tuple[int, ...]]]):
        self._by_storage: Dict[StorageKey, Optional[Guarded]] = {}
        self.optimizers = 0
        for opt, ids in optimizers:
            if type(opt).__name__ in _UPDATE_IN_BACKWARD:
                continue
            self.optimizers += 1
            guard = Guard(opt, ids)
            for group in opt.param_groups:
                for p in group.get("params", ()):
                    if not isinstance(p, torch.Tensor):
                        continue
                    self._add(guard, Holder(p, "parameter"), shared=bool(getattr(p, "_in_backward_optimizers", None)))
                    for name, v in opt.state.get(p, {}).items():
                        if isinstance(v, torch.Tensor):
                            self._add(guard, Holder(v, f"state {name!r}"))

    def _add(self, guard: Guard, holder: Holder, shared: bool = False) -> None:
        key = storage_key(holder.tensor)
        if key is None:
            return
        if shared:
            self._by_storage[key] = None
            return
        if key not in self._by_storage:
            self._by_storage[key] = Guarded(guard)
        entry = self._by_storage[key]
        if entry is None:
            return
        if entry.guard.optimizer is not guard.optimizer:
            self._by_storage[key] = None
            return
        entry.holders.append(holder)

    def of(self, src: torch.Tensor) -> Optional[Guarded]:
        """The guard of a write source (a view of optimizer-held memory), if one optimizer's step is
        the only writer of its memory and it is big enough to be worth deferring."""
        if nbytes(src) < SMALL_BYTES or not self._by_storage:
            return None
        key = storage_key(src)
        return self._by_storage.get(key) if key is not None else None

    def __bool__(self) -> bool:
        return any(g is not None for g in self._by_storage.values())


NO_GUARDS = Guards(())


def closure_first(opt: Any) -> bool:
    """True when `opt.step(closure)` evaluates the closure before it changes anything: torch's own
    optimizers do (`loss = closure()` first). Anything else waits before its closure runs (a SAM-style
    optimizer changes the parameters before calling it)."""
    return type(opt).__module__.startswith("torch.optim.")


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
                    self._watch.append((key, entry.guard, h, h.tensor._version))
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
            now = h.tensor._version
            if now != was:
                self.error = _changed_error(self.path, key, g, h, was, now, where)
                return

    def land(self) -> None:
        """The copies are in the slot: check every optimizer's tensors not yet past the fence, then
        let steps go. Called on the job thread, exactly once (also after a failed copy)."""
        with self._lock:
            self._check("while its copy was pending")
            self._landed.set()
        _release(self)

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error if isinstance(error, CheckpointError) else CheckpointError(
                    f"async staging: copying the optimizers' tensors for {self.path!r} failed: {error}")
            self._landed.set()
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
_FENCES: "weakref.WeakSet[StepFence]" = weakref.WeakSet()  # open fences that deferred copies
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


class StepFence:
    """One Checkpointer's pending copies (load(), restore() and close() drain them). The steps are
    held by the process's one global step pre-hook, which looks at every fence's pending copies."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._pending: List[Pending] = []
        self._lock = threading.Lock()
        _install()  # at setup, not from a save that may run beside a step on another thread

    def add(self, pending: Pending) -> None:
        pending.timeout_s = self.timeout_s
        with self._lock:
            self._pending = [p for p in self._pending if not p.landed] + [pending]
        _FENCES.add(self)
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
        _FENCES.discard(self)


def _wait_for(opt: Any) -> None:
    """Hold `opt`'s step until the copies of its tensors landed (every save's, read now)."""
    for p in _HELD:
        if p.holds(opt):
            p.pass_fence(opt)


def _step_pre_hook(opt: Any, args: tuple, kwargs: dict):
    """torch calls this before every Optimizer.step (args[0] is the optimizer itself)."""
    if not _HELD and not _FENCES:  # nothing pending and no async staging open: the per-step cost
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
    reaches torch's step hooks (it would never fire), the trigger disarms; remove() disarms it too."""

    def __init__(self, optimizers: Callable[[Any], Optional[Sequence[Any]]], fn: Callable[[Any], None],
                 owner: Any):
        global _TRIGGERS
        self._optimizers, self._fn = optimizers, fn
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
            self._fn(owner)
        except Exception as exc:  # noqa: BLE001 - a warm-up never breaks training; the first save allocates
            log.warning("bytecheckpoint: the automatic staging warm-up failed (the first async save will allocate "
                        "its buffers instead): %s", exc)
