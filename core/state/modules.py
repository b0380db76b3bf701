"""Handlers of nn.Module and torch.optim.Optimizer: a module as its state dict (FSDP1 through
state/fsdp1.py), an optimizer keyed by parameter name through the module in the same state that owns
its parameters, so optimizer state reshards with the model. Registered by state/registry.py.

torch.compile: a compiled module (or submodule) spells its state dict names with `_orig_mod.`; they
are saved without the wrappers' `_orig_mod` (the module's own names, as DCP names the optimizer state
and as the module has when not compiled; a real submodule named `_orig_mod` keeps its name), and a
load maps the live names onto the saved ones either way, so compiled and plain modules load each
other's checkpoints, and checkpoints saved with `_orig_mod.` still load."""
from __future__ import annotations

import sys
from typing import Any, Dict, Iterable, List, Mapping, Optional, Set, Tuple

import torch
from torch import nn

from ..common.errors import StateMismatchError
from ..format import codec
from . import fsdp1, namespace, optimizer_form, optimizers
from .flatten import Handler, ModuleView, find_subtree, join

COMPILED_PREFIX = "_orig_mod"   # torch._dynamo's OptimizedModule holds the module under this attribute


def compiled_paths(module: nn.Module) -> Set[str]:
    """Module paths ("" for `module` itself) of the torch.compile wrappers (OptimizedModule) in
    `module`'s tree. None can exist before torch._dynamo was imported: then nothing is walked."""
    wrapper = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    if wrapper is None:
        return set()
    return {name for name, m in module.named_modules(remove_duplicate=False) if isinstance(m, wrapper)}


def own_names(names: Iterable[Any], module: nn.Module) -> Dict[Any, Any]:
    """name -> the module's own name: the `_orig_mod` components that are a torch.compile wrapper's
    (DCP's rule for FQNs) left out; a real submodule that happens to be called `_orig_mod` keeps its
    name. Names without `_orig_mod` cost a substring test (no walk of the module tree)."""
    names = list(names)
    spelled = [k for k in names if isinstance(k, str) and COMPILED_PREFIX in k]
    wrappers = compiled_paths(module) if spelled else set()
    out = {k: k for k in names}
    for k in spelled:
        parts = k.split(".")
        out[k] = ".".join(p for i, p in enumerate(parts)
                          if not (p == COMPILED_PREFIX and ".".join(parts[:i]) in wrappers))
    return out


def saved_own_names(names: Iterable[str]) -> Dict[str, str]:
    """name -> own name for names read from a checkpoint, where the module is not at hand (export,
    and checkpoints saved with the wrappers' `_orig_mod.`, before they were left out): an `_orig_mod`
    component is a wrapper's when it is the only thing below its prefix (an OptimizedModule holds
    nothing but `_orig_mod`); beside siblings it is a submodule's real name."""
    names = list(names)
    below: Dict[Tuple[str, ...], Set[str]] = {}
    for k in names:
        if COMPILED_PREFIX in k:
            parts = tuple(k.split("."))
            for i in range(len(parts)):
                below.setdefault(parts[:i], set())
    if not below:
        return {k: k for k in names}
    for k in names:
        parts = tuple(k.split("."))
        for i in range(len(parts)):
            if parts[:i] in below:
                below[parts[:i]].add(parts[i])
    out = {}
    for k in names:
        parts = k.split(".")
        out[k] = ".".join(p for i, p in enumerate(parts)
                          if not (p == COMPILED_PREFIX and below.get(tuple(parts[:i])) == {COMPILED_PREFIX}))
    return out


def own_state_dict(sd: Mapping[str, Any], module: nn.Module, where: str) -> Dict[str, Any]:
    """`sd` (`module`'s state dict, or names below it) under the module's own names (own_names)."""
    if not any(isinstance(k, str) and COMPILED_PREFIX in k for k in sd):
        return dict(sd)  # the common case: one substring test per name
    names = own_names(sd, module)
    out = {names[k]: v for k, v in sd.items()}
    if len(out) != len(sd):  # not for a real module's names: kept here as the guard of what is saved
        seen: Dict[Any, Any] = {}
        for k in sd:
            if names[k] in seen:
                raise StateMismatchError(f"{where}: state dict names {seen[names[k]]!r} and {k!r} are both "
                                         f"{names[k]!r} without torch.compile's '_orig_mod.'; rename one of them")
            seen[names[k]] = k
    return out


def saved_spelling(own: Iterable[Any], saved_node: Any) -> Dict[Any, Any]:
    """own name -> the name to load it from: the same name where the checkpoint has it, else the
    checkpoint's spelling of it with torch.compile's `_orig_mod.` (saved before they were left out)."""
    saved = set()
    if isinstance(saved_node, dict) and len(saved_node) == 1 and "dict" in saved_node:
        saved = {n for n in (codec.decode(k) for k, _ in saved_node["dict"]) if isinstance(n, str)}
    own = list(own)
    old: Dict[str, str] = {}
    if any(k not in saved for k in own) and any(COMPILED_PREFIX in n for n in saved):
        for name, plain in saved_own_names(sorted(saved)).items():
            if plain not in saved:
                old[plain] = name
    return {k: k if k in saved else old.get(k, k) for k in own}


class ModuleHandler(Handler):
    def save(self, value, key, walk):
        if fsdp1.holds_fsdp1(value):
            return fsdp1.save_module(value, key, walk)
        return walk.save(own_state_dict(value.state_dict(), value, f"module {key!r}"), key)

    def load(self, value, key, walk, assign):
        if fsdp1.holds_fsdp1(value):
            return fsdp1.load_module(value, key, walk)
        load_by_own_names(value.state_dict(), value, value.load_state_dict, key, walk, f"module {key!r}")


class ModuleViewHandler(Handler):
    """bcp.ModuleView: its state dict, saved and loaded in place like a module's (own names)."""

    def save(self, value: ModuleView, key, walk):
        return walk.save(own_state_dict(value.state_dict(), value.module, f"module view {key!r}"), key)

    def load(self, value: ModuleView, key, walk, assign):
        load_by_own_names(dict(value.state_dict()), value.module, value.load_state_dict, key, walk,
                          f"module view {key!r}")


def load_by_own_names(live: Mapping[str, Any], module: nn.Module, load_state_dict, key: str, walk, where: str
                      ) -> None:
    """Load `live` (a state dict of `module` whose tensors are loaded in place) from the names saved
    at `key`, then `load_state_dict(live)` with the values the load assigned (plain values, loaded
    whole)."""
    own = own_names(live, module)
    spelling = saved_spelling(own.values(), find_subtree(walk.saved, key))
    template: Dict[Any, Any] = {}
    saved_as: Dict[Any, Any] = {}
    for k, v in live.items():
        name = spelling[own[k]]
        if name in template:
            raise StateMismatchError(f"{where}: state dict names {saved_as[name]!r} and {k!r} both load from "
                                     f"{name!r} (the same without torch.compile's '_orig_mod.'); rename one of them")
        template[name], saved_as[name] = v, k
    walk.load(template, key, lambda v: None)
    walk.flat.finalizers.append(lambda: load_state_dict({k: template[spelling[own[k]]] for k in live}))


class OptimizerHandler(Handler):
    """Keyed by parameter name (via the module in the same state that owns the parameters), so
    optimizer state reshards with the model; without such a module, falls back to index keys.
    A fresh optimizer (every resume after a failure) gets the state tensors the checkpoint holds
    made directly, for torch's own optimizers, instead of by a zero-lr step (state/optimizers.py)."""

    def __init__(self) -> None:
        self.names = optimizers.NameCache()
        self.namespaces = namespace.Namespaces()

    def save(self, value, key, walk):
        model = self.owner(value, walk)
        if model is None:
            return walk.registry.stateful.save(value, key, walk)
        if fsdp1.uses_flat_route(model, walk.fsdp1_route):
            return fsdp1.save_optimizer(value, model, key, walk)
        if fsdp1.holds_fsdp1(model):
            return optimizer_form.save(optimizers.named_optimizer_state(model, value), key, walk)
        return optimizer_form.save(self.names.state_dict(model, value), key, walk)

    def group_names(self, optim: torch.optim.Optimizer, model: nn.Module, walk) -> List[List[str]]:
        """Each param group's parameter names, as `save` names the optimizer's state (`model` from
        `owner`); no side effects. The FSDP1 flat route names them from FSDP's bookkeeping, as
        fsdp1.save_optimizer does (no optimizer state dict of FSDP's, no collective)."""
        if fsdp1.uses_flat_route(model, walk.fsdp1_route):
            return fsdp1.layout_fqns(optim, model, fsdp1.flat_layout(model))
        osd = self.names.state_dict(model, optim, with_state=False)  # DCP's names, cached per optimizer
        return [list(g.get("params", [])) for g in osd.get("param_groups", [])]

    def owner(self, optim: torch.optim.Optimizer, walk) -> Optional[nn.Module]:
        """The module whose names name `optim`'s parameters: the one module in the state that owns
        them all, or several model parts' one namespace (state/parts.py); None: index keys."""
        found = {id(walk.param_owner.get(id(p))): walk.param_owner.get(id(p))
                 for g in optim.param_groups for p in g["params"]}
        if None in found.values() or not found:
            return None
        if len(found) == 1:
            return next(iter(found.values()))
        return self.namespaces.of(list(found.values()))

    def load(self, value, key, walk, assign):
        model = self.owner(value, walk)
        if model is None:
            return walk.registry.stateful.load(value, key, walk, assign)
        if fsdp1.uses_flat_route(model, walk.fsdp1_route):
            return fsdp1.load_optimizer(value, model, key, walk)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
        by_name = optimizer_form.saved_by_name(walk.saved, key)
        # A state dict of plain values only is loaded whole (assign); otherwise in place.
        loaded = {}
        if optimizers.saved_without_state(walk.saved, key):
            # Saved before its first step: the loaded optimizer has no state either, exactly as saved.
            loaded["osd"] = optimizers.named_optimizer_state(model, value, with_state=False)
            if by_name:
                form = optimizer_form.ByNameLoad(loaded["osd"], key, walk, with_state=False)
                walk.flat.finalizers.append(lambda: optimizers.load_groups_only(value, form.result()))
                return
            walk.load(loaded["osd"], key, lambda v: loaded.__setitem__("osd", v))
            walk.flat.finalizers.append(lambda: optimizers.load_groups_only(value, loaded["osd"]))
            return
        if fsdp1.holds_fsdp1(model):
            loaded["osd"] = get_optimizer_state_dict(model, value)  # creates state for a fresh target: the template
        else:
            if not value.state:
                how = optimizers.create_state_from_checkpoint(model, value, find_subtree(walk.saved, join(key, "state")),
                                                               self.names)
                walk.flat.notes[key] = how
                if value.state:  # made here from nothing: a failed load leaves the optimizer as it was
                    walk.flat.undo.append(value.state.clear)
            # still without state (an optimizer not known here): torch's own zero-lr step makes it
            loaded["osd"] = self.names.state_dict(model, value) if value.state else get_optimizer_state_dict(model,
                                                                                                            value)
        if by_name:
            form = optimizer_form.ByNameLoad(loaded["osd"], key, walk)
            walk.flat.finalizers.append(lambda: set_optimizer_state_dict(model, value, form.result()))
            return
        walk.load(loaded["osd"], key, lambda v: loaded.__setitem__("osd", v))
        walk.flat.finalizers.append(lambda: set_optimizer_state_dict(model, value, loaded["osd"]))
