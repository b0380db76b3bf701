"""Model parts: several modules under one key whose parameter names form one namespace.

A pipeline rank may hold several stages (the interleaved schedules' virtual stages) and a
torchtitan run keeps its model as a list of parts, each a copy of the whole model with the layers
it does not own deleted, so names stay global (`layers.2.w` on the part that owns layer 2). Saved
as one namespace, as torchtitan's ModelWrapper merges them, a list of parts loads into any other
list of parts, into a single module, and back:

    state = {"model": [stage0, stage2], "optimizer": [opt0, opt2]}    # or one optimizer over both
    -> model/<name> and optimizer/state/<name>/..., optimizer/param_groups/<name>

A list of modules (or of optimizers keyed by name) under one key is saved this way when their
names are disjoint; a list whose names collide (a GAN's generator and discriminator) keeps index
keys (`model/0/...`), as does a list holding an FSDP1 model. A load follows the saved form.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
from torch import nn

from . import fsdp1, optimizer_form
from .modules import OptimizerHandler, load_by_own_names, own_names, own_state_dict
from .basic import ListHandler, TupleHandler
from .flatten import find_subtree


def _names_disjoint(name_lists: List[List[str]]) -> bool:
    seen: set = set()
    for names in name_lists:
        for n in names:
            if n in seen:
                return False
            seen.add(n)
    return True


def _module_parts(value: Any) -> bool:
    return bool(value) and all(isinstance(v, nn.Module) for v in value) and not any(
        fsdp1.holds_fsdp1(v) for v in value)


def _optimizer_parts(value: Any, walk) -> Optional[List[Any]]:
    """(optimizer, its handler, its names module) for each item, when every item is an optimizer
    saved by name (state/modules.py) and no parameter name is in two of them; else None."""
    if not value or not all(isinstance(v, torch.optim.Optimizer) for v in value):
        return None
    items = []
    for opt in value:
        handler = walk.registry.handler_for(opt)
        owner = handler.owner(opt, walk) if isinstance(handler, OptimizerHandler) else None
        if owner is None or fsdp1.holds_fsdp1(owner):
            return None
        items.append((opt, handler, owner))
    names = [[n for g in h.names.state_dict(m, o, with_state=False)["param_groups"] for n in g["params"]]
             for o, h, m in items]
    return items if _names_disjoint(names) else None


def _merged_state_dict(value: Sequence[nn.Module], key: str) -> Optional[dict]:
    """The parts' state dicts (own names) as one, or None where two parts hold the same name."""
    sds = [own_state_dict(m.state_dict(), m, f"model part {i} of {key!r}") for i, m in enumerate(value)]
    if not _names_disjoint([list(sd) for sd in sds]):
        return None
    return {k: v for sd in sds for k, v in sd.items()}


def _live_names_disjoint(value: Sequence[nn.Module]) -> bool:
    return _names_disjoint([list(own_names(m.state_dict(keep_vars=True), m).values()) for m in value])


class _PartsMixin:
    """A list/tuple of model parts (modules, or optimizers keyed by name) saved as one namespace."""

    def save(self, value, key, walk):
        merged = _merged_state_dict(value, key) if key and _module_parts(value) else None
        if merged is not None:
            return walk.registry.handler_for(merged).save_items(merged, key, walk)
        items = _optimizer_parts(value, walk) if key else None
        if items is not None:
            return optimizer_form.merge([h.save(o, key, walk) for o, h, _ in items])
        return super().save(value, key, walk)

    def load(self, value, key, walk, assign):
        saved = find_subtree(walk.saved, key)
        indexed = isinstance(saved, dict) and next(iter(saved), None) in ("list", "tuple")
        if key and not indexed and _module_parts(value) and _live_names_disjoint(value):
            for i, m in enumerate(value):
                load_by_own_names(m.state_dict(), m, m.load_state_dict, key, walk, f"model part {i} of {key!r}")
            return
        if key and not indexed and _optimizer_parts(value, walk) is not None:
            for opt in value:
                walk.load(opt, key, lambda v: None)
            return
        return super().load(value, key, walk, assign)


class PartsListHandler(_PartsMixin, ListHandler):
    pass


class PartsTupleHandler(_PartsMixin, TupleHandler):
    pass
