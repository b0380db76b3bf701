"""Handlers of nn.Module and torch.optim.Optimizer: a module as its state dict (FSDP1 through
state/fsdp1.py), an optimizer keyed by parameter name through the module in the same state that owns
its parameters, so optimizer state reshards with the model. Registered by state/registry.py.

torch.compile: a compiled module (or submodule) spells its state dict names with `_orig_mod.`; they
are saved without it (the module's own names, as DCP names the optimizer state and as the module
has when not compiled), and a load maps the live names onto the saved ones either way, so compiled
and plain modules load each other's checkpoints, and checkpoints saved with `_orig_mod.` still load."""
from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, Optional

import torch
from torch import nn

from ..common.errors import StateMismatchError
from ..format import codec
from . import fsdp1, optimizers
from .flatten import Handler, ModuleView, find_subtree, join

COMPILED_PREFIX = "_orig_mod"   # torch._dynamo's OptimizedModule holds the module under this attribute


def plain_name(name: str) -> str:
    """A state dict name without torch.compile's `_orig_mod` components (DCP's rule for FQNs)."""
    if COMPILED_PREFIX not in name:
        return name
    return ".".join(p for p in name.split(".") if p != COMPILED_PREFIX)


def plain_state_dict(sd: Mapping[str, Any], where: str) -> Dict[str, Any]:
    """`sd` under plain names; two names that become one are refused."""
    out: Dict[str, Any] = {}
    spelled: Dict[str, str] = {}
    for k, v in sd.items():
        p = plain_name(k) if isinstance(k, str) else k
        if p in out:
            raise StateMismatchError(
                f"{where}: state dict names {spelled[p]!r} and {k!r} are the same without torch.compile's "
                f"'_orig_mod.' ({p!r}); rename one of the modules")
        out[p], spelled[p] = v, k
    return out


def saved_spelling(live: Iterable[str], saved_node: Any) -> Dict[str, str]:
    """live name -> the name to load it from: its plain name, or the checkpoint's own spelling of
    that plain name (a checkpoint saved with '_orig_mod.' names, before they were stripped)."""
    saved: Dict[str, str] = {}
    if isinstance(saved_node, dict) and len(saved_node) == 1 and "dict" in saved_node:
        for k, _ in saved_node["dict"]:
            name = codec.decode(k)
            if isinstance(name, str):
                saved.setdefault(plain_name(name), name)
    out = {}
    for k in live:
        p = plain_name(k) if isinstance(k, str) else k
        out[k] = p if p in saved and saved[p] == p else saved.get(p, p)
    return out


class ModuleHandler(Handler):
    def save(self, value, key, walk):
        if fsdp1.holds_fsdp1(value):
            return fsdp1.save_module(value, key, walk)
        return walk.save(plain_state_dict(value.state_dict(), f"module {key!r}"), key)

    def load(self, value, key, walk, assign):
        if fsdp1.holds_fsdp1(value):
            return fsdp1.load_module(value, key, walk)
        load_by_plain_names(value.state_dict(), value.load_state_dict, key, walk, f"module {key!r}")


class ModuleViewHandler(Handler):
    """bcp.ModuleView: its state dict, saved and loaded in place like a module's (plain names)."""

    def save(self, value: ModuleView, key, walk):
        return walk.save(plain_state_dict(value.state_dict(), f"module view {key!r}"), key)

    def load(self, value: ModuleView, key, walk, assign):
        load_by_plain_names(dict(value.state_dict()), value.load_state_dict, key, walk, f"module view {key!r}")


def load_by_plain_names(live: Mapping[str, Any], load_state_dict, key: str, walk, where: str) -> None:
    """Load `live` (a state dict whose tensors are loaded in place) from the names saved at `key`,
    then `load_state_dict(live)` with the values the load assigned (plain values, loaded whole)."""
    spelling = saved_spelling(live, find_subtree(walk.saved, key))
    template: Dict[str, Any] = {}
    for k, v in live.items():
        if spelling[k] in template:
            raise StateMismatchError(f"{where}: state dict names {k!r} and another one are the same without "
                                     f"torch.compile's '_orig_mod.' ({spelling[k]!r}); rename one of the modules")
        template[spelling[k]] = v
    walk.load(template, key, lambda v: None)
    walk.flat.finalizers.append(lambda: load_state_dict({k: template[spelling[k]] for k in live}))


class OptimizerHandler(Handler):
    """Keyed by parameter name (via the module in the same state that owns the parameters), so
    optimizer state reshards with the model; without such a module, falls back to index keys.
    A fresh optimizer (every resume after a failure) gets the state tensors the checkpoint holds
    made directly, for torch's own optimizers, instead of by a zero-lr step (state/optimizers.py)."""

    def __init__(self) -> None:
        self.names = optimizers.NameCache()

    def save(self, value, key, walk):
        model = _owner_module(value, walk.param_owner)
        if model is None:
            return walk.registry.stateful.save(value, key, walk)
        if fsdp1.uses_flat_route(model, walk.fsdp1_route):
            return fsdp1.save_optimizer(value, model, key, walk)
        if fsdp1.holds_fsdp1(model):
            return walk.save(optimizers.named_optimizer_state(model, value), key)
        return walk.save(self.names.state_dict(model, value), key)

    def load(self, value, key, walk, assign):
        model = _owner_module(value, walk.param_owner)
        if model is None:
            return walk.registry.stateful.load(value, key, walk, assign)
        if fsdp1.uses_flat_route(model, walk.fsdp1_route):
            return fsdp1.load_optimizer(value, model, key, walk)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
        # A state dict of plain values only is loaded whole (assign); otherwise in place.
        loaded = {}
        if optimizers.saved_without_state(walk.saved, key):
            # Saved before its first step: the loaded optimizer has no state either, exactly as saved.
            loaded["osd"] = optimizers.named_optimizer_state(model, value, with_state=False)
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
        walk.load(loaded["osd"], key, lambda v: loaded.__setitem__("osd", v))
        walk.flat.finalizers.append(lambda: set_optimizer_state_dict(model, value, loaded["osd"]))


def _owner_module(optim: torch.optim.Optimizer, owners: Dict[int, nn.Module]) -> Optional[nn.Module]:
    found = {id(owners.get(id(p))) : owners.get(id(p)) for g in optim.param_groups for p in g["params"]}
    if len(found) == 1 and None not in found.values():
        return next(iter(found.values()))
    return None
