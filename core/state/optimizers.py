"""Optimizer state keyed by parameter name, read and written without side effects (shared by
the plain-module handler and the FSDP1 flat route)."""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Optional

import torch
from torch import nn

from ..common.errors import StateMismatchError
from .flatten import find_subtree, join


def named_optimizer_state(model: nn.Module, optim: torch.optim.Optimizer, with_state: bool = True) -> Dict:
    """torch's parameter-name-keyed optimizer state dict, without side effects. For an optimizer
    with no state yet torch would run a zero-lr step() to create it (a checkpoint must never change
    training): empty placeholder entries make it skip that, and the state is put back. Every
    parameter gets one: FSDP1 with use_orig_params=True refuses a state that holds some of a flat
    parameter's original parameters and not others ("... is not in the optimizer state")."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    params = [p for g in optim.param_groups for p in g["params"]]
    if (with_state and optim.state) or not params:
        return get_optimizer_state_dict(model, optim)
    kept = dict(optim.state)
    optim.state.clear()
    optim.state.update((p, {}) for p in params)
    try:
        osd = get_optimizer_state_dict(model, optim)
    finally:
        optim.state.clear()
        optim.state.update(kept)
    osd["state"] = {}
    return osd


def saved_without_state(saved: Any, key: str) -> bool:
    """The checkpoint holds this optimizer's state as plain values only (no tensors): it was saved
    before its first step (the whole state dict, or its "state" entry, is one plain value)."""
    if saved is None:
        return False
    whole, state = find_subtree(saved, key), find_subtree(saved, join(key, "state"))
    return any(isinstance(n, dict) and ("object" in n or n == {"dict": []}) for n in (whole, state))


def load_groups_only(optim: torch.optim.Optimizer, osd: Dict) -> None:
    """Hyper-parameters from the checkpoint's param groups, no state (what a fresh save holds)."""
    optim.state.clear()
    saved = osd.get("param_groups", [])
    if len(saved) != len(optim.param_groups):
        raise StateMismatchError(f"optimizer: the checkpoint has {len(saved)} param groups, the optimizer "
                                 f"{len(optim.param_groups)}; build it with the same groups")
    for group, values in zip(optim.param_groups, saved):
        group.update({k: v for k, v in values.items() if k != "params"})


# ---------------------------------------------------------------------- names, cached

class NameCache:
    """torch's parameter-name-keyed optimizer state dict (what `named_optimizer_state` returns),
    built from DCP's names of the optimizer's parameters, which are taken once per optimizer and
    reused while its parameters, module and state_dict() stay the same: DCP recomputes every
    name on every call (~30 ms per save of a 219-parameter model on this project's CPU).
    A cache of derived data only (weak on the optimizer); anything unusual goes to DCP."""

    def __init__(self) -> None:
        self._names: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, with_state: bool = True) -> Dict:
        osd = self._from_cache(model, optim, with_state)
        if osd is not None:
            return osd
        osd = named_optimizer_state(model, optim, with_state)
        self._remember(model, optim, osd)
        return osd

    def _remember(self, model: nn.Module, optim: torch.optim.Optimizer, osd: Dict) -> None:
        params = [p for g in optim.param_groups for p in g["params"]]
        fqns = [n for g in osd.get("param_groups", []) for n in g.get("params", [])]
        if len(fqns) == len(params) and _plain_state_dict(optim):
            self._names[optim] = (weakref.ref(model), tuple(params), {id(p): n for p, n in zip(params, fqns)})

    def _from_cache(self, model: nn.Module, optim: torch.optim.Optimizer, with_state: bool) -> Optional[Dict]:
        cached = self._names.get(optim)
        if cached is None or cached[0]() is not model or not _plain_state_dict(optim):
            return None
        params = [p for g in optim.param_groups for p in g["params"]]
        if len(params) != len(cached[1]) or any(a is not b for a, b in zip(params, cached[1])):
            return None
        names = cached[2]
        state = {}
        for k, v in (optim.state.items() if with_state else ()):  # state_dict()'s order, keys renamed as DCP does
            if isinstance(k, torch.Tensor):
                if id(k) not in names:
                    return None
                k = names[id(k)]
            state[k] = v
        groups = []
        for g in optim.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = [names[id(p)] for p in g["params"]]
            groups.append(packed)
        return {"state": state, "param_groups": groups}


def _plain_state_dict(optim: torch.optim.Optimizer) -> bool:
    """Optimizer.state_dict() itself, with no hooks (what the cached path reproduces)."""
    return (type(optim).state_dict is torch.optim.Optimizer.state_dict
            and not getattr(optim, "_optimizer_state_dict_pre_hooks", None)
            and not getattr(optim, "_optimizer_state_dict_post_hooks", None))


# ---------------------------------------------------------------------- fresh state, directly

def _scalar_dtype(fused: bool = False) -> torch.dtype:
    """torch.optim's dtype for step-like scalars (torch.optim.optimizer._get_scalar_dtype)."""
    if fused:
        return torch.float32
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _step_adam(p, g, value=0.0):
    fused = bool(g.get("fused"))
    on_device = bool(g.get("capturable")) or fused
    return torch.full((), value, dtype=_scalar_dtype(fused), device=p.device if on_device else "cpu")


def _step(p, g, value=0.0):
    return torch.full((), value, dtype=_scalar_dtype(), device=p.device if g.get("capturable") else "cpu")


def _like(p, g):
    # torch's first step makes zeros; the load overwrites every tensor made here (only the keys the
    # checkpoint holds are made), so no fill pass: its pages are touched once, by the read
    return torch.empty_like(p, memory_format=torch.preserve_format)


def _adam_keys(g):
    return {"step": _step_adam, "exp_avg": _like, "exp_avg_sq": _like,
            **({"max_exp_avg_sq": _like} if g.get("amsgrad") else {})}


# class name -> (param group -> {state key: maker(param, group)}): what each of torch's optimizers
# creates at its first step (torch/optim/*.py `_init_group`), so a fresh optimizer gets the
# tensors a checkpoint's state loads into without running that step.
_MAKERS: Dict[str, Callable[[Dict], Dict[str, Callable]]] = {
    "torch.optim.adam.Adam": _adam_keys,
    "torch.optim.adamw.AdamW": _adam_keys,
    "torch.optim.sgd.SGD": lambda g: {"momentum_buffer": _like} if g.get("momentum") else {},
    "torch.optim.rmsprop.RMSprop": lambda g: {
        "step": _step, "square_avg": _like, **({"momentum_buffer": _like} if g.get("momentum", 0) > 0 else {}),
        **({"grad_avg": _like} if g.get("centered") else {})},
    "torch.optim.adamax.Adamax": lambda g: {"step": _step, "exp_avg": _like, "exp_inf": _like},
    "torch.optim.nadam.NAdam": lambda g: {"step": _step, "mu_product": lambda p, g: _step(p, g, 1.0),
                                          "exp_avg": _like, "exp_avg_sq": _like},
    "torch.optim.radam.RAdam": lambda g: {"step": _step, "exp_avg": _like, "exp_avg_sq": _like},
    "torch.optim.adadelta.Adadelta": lambda g: {"step": _step, "square_avg": _like, "acc_delta": _like},
}


def create_state_from_checkpoint(model: nn.Module, optim: torch.optim.Optimizer, saved_state: Any,
                                 names: NameCache) -> str:
    """Give a fresh optimizer (no state) the state tensors its checkpoint holds, made as the
    optimizer's own first step would make them, instead of running that step (what DCP's
    get_optimizer_state_dict does: a full zero-lr step). Returns how the state was made, for
    LoadStats.optimizer_state: "created" (no step ran), or "torch step (<why>)" when the class
    or the saved keys are not known here (then torch's path runs, as before)."""
    klass = type(optim)
    makers_of = _MAKERS.get(f"{klass.__module__}.{klass.__qualname__}")
    if makers_of is None:
        return f"torch step ({klass.__qualname__} is not one of torch's optimizers known here)"
    saved = _saved_state_keys(saved_state)
    if saved is None:
        return "torch step (the checkpoint's optimizer state has an unexpected layout)"
    fqn_of = {id(p): n for n, p in _named_params(model, optim, names)}
    made: Dict[torch.Tensor, Dict[str, torch.Tensor]] = {}
    for g in optim.param_groups:
        makers = makers_of(g)
        for p in g["params"]:
            keys = saved.get(fqn_of.get(id(p)))
            if keys is None:
                continue  # no saved state for it: none after torch's load either
            if set(keys) != set(makers) or any(kind != "tensor" for kind in keys.values()):
                return (f"torch step (the checkpoint holds state {sorted(keys)} for {fqn_of[id(p)]!r}, "
                        f"{klass.__qualname__} with these settings makes {sorted(makers)})")
            made[p] = {k: makers[k](p, g) for k in keys}
    if not made:
        return "torch step (no saved state matches the optimizer's parameters)"
    with torch.no_grad():
        optim.state.update(made)
    return "created"


def _named_params(model: nn.Module, optim: torch.optim.Optimizer, names: NameCache):
    """(DCP name, parameter) of every parameter of the optimizer (names without a state step)."""
    osd = names.state_dict(model, optim, with_state=False)
    params = [p for g in optim.param_groups for p in g["params"]]
    fqns = [n for g in osd["param_groups"] for n in g["params"]]
    return list(zip(fqns, params))


def _saved_state_keys(node: Any) -> Optional[Dict[str, Dict[str, str]]]:
    """{param name: {state key: 'tensor' | 'object'}} from the structure of a saved "state" dict."""
    from ..format import codec
    if not (isinstance(node, dict) and set(node) == {"dict"}):
        return None
    out: Dict[str, Dict[str, str]] = {}
    for k, child in node["dict"]:
        if not (isinstance(child, dict) and set(child) == {"dict"}):
            return None
        keys = {}
        for sk, leaf in child["dict"]:
            if not (isinstance(leaf, dict) and len(leaf) == 1 and next(iter(leaf)) in ("tensor", "object")):
                return None
            keys[str(codec.decode(sk))] = next(iter(leaf))
        out[str(codec.decode(k))] = keys
    return out
