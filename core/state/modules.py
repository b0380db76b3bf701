"""Handlers of nn.Module and torch.optim.Optimizer: a module as its state dict (FSDP1 through
state/fsdp1.py), an optimizer keyed by parameter name through the module in the same state that owns
its parameters, so optimizer state reshards with the model. Registered by state/registry.py."""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

from . import fsdp1, optimizers
from .flatten import Handler, find_subtree, join


class ModuleHandler(Handler):
    def save(self, value, key, walk):
        if fsdp1.holds_fsdp1(value):
            return fsdp1.save_module(value, key, walk)
        return walk.save(dict(value.state_dict()), key)

    def load(self, value, key, walk, assign):
        if fsdp1.holds_fsdp1(value):
            return fsdp1.load_module(value, key, walk)
        sd = value.state_dict()
        walk.load(sd, key, lambda v: None)
        walk.flat.finalizers.append(lambda: value.load_state_dict(sd))


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
