"""Async staging's guards: which tensors only one optimizer's step changes (the copies that may be
deferred until that step), found in the saved state by memory (storage), and torch's version counters
that tell whether anything else changed them meanwhile (read by gate.Pending). Pure lookups: no
hooks, no threads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..state.flatten import ModuleView, each_leaf

# Sources smaller than this are copied before save() returns (biases, scalars, `step` counters):
# cheaper to copy than to track.
SMALL_BYTES = 64 << 10
# Optimizers that update parameters inside backward (no step to hold): their tensors are copied now.
_UPDATE_IN_BACKWARD = ("Lomo", "AdaLomo")

StorageKey = Tuple[str, int]


def version(t: torch.Tensor) -> int:
    """torch's version counter of `t`; a DTensor's plus its local tensor's: an in-place op on the
    DTensor moves only its own, a write through to_local() (FSDP2 resharding) only the local one. Both
    only grow, so the sum changes when either does."""
    local = getattr(t, "_local_tensor", None)
    return t._version + (local._version if isinstance(local, torch.Tensor) and local is not t else 0)


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

    def __init__(self, optimizers: Sequence[Tuple[Any, Tuple[int, ...]]], forward_writes: Iterable[torch.Tensor] = ()):
        self._by_storage: Dict[StorageKey, Optional[Guarded]] = {}
        self.optimizers = 0
        for opt, ids in optimizers:
            if type(opt).__name__ in _UPDATE_IN_BACKWARD:
                continue
            if any(g.get("capturable") for g in opt.param_groups):
                continue  # a step captured in a CUDA graph replays without hooks: nothing to hold it
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
        for t in forward_writes:  # the next forward changes them: nobody's (copied before save() returns)
            key = storage_key(t)
            if key is not None:
                self._by_storage[key] = None

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


def written_in_forward(state: Any) -> List[torch.Tensor]:
    """Optimizer-held tensors a forward pass changes in place, in the modules of `state`:
    nn.Embedding / EmbeddingBag with max_norm renormalise the rows they look up (deferring them would
    fail every save through the guard). Modules saved as state dicts are not seen (their saves fail
    with the guard's error, which names the fix)."""
    found: List[torch.Tensor] = []

    def visit(v: Any) -> None:
        module = v.module if isinstance(v, ModuleView) else v
        if isinstance(module, torch.nn.Module):
            found.extend(m.weight for m in module.modules()
                         if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.max_norm is not None)
    each_leaf(state, visit)
    return found


def closure_first(opt: Any) -> bool:
    """True when `opt.step(closure)` evaluates the closure before it changes anything: torch's own
    optimizers do (`loss = closure()` first). Anything else waits before its closure runs (a SAM-style
    optimizer changes the parameters before calling it)."""
    return type(opt).__module__.startswith("torch.optim.")
