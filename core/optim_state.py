"""Optimizer state keyed by parameter name, read and written without side effects (shared by
the plain-module handler and the FSDP1 flat route)."""
from __future__ import annotations

from typing import Any, Dict

import torch
from torch import nn

from .errors import StateMismatchError
from .flatten import find_subtree, join


def named_optimizer_state(model: nn.Module, optim: torch.optim.Optimizer, with_state: bool = True) -> Dict:
    """torch's parameter-name-keyed optimizer state dict, without side effects. For an optimizer
    with no state yet torch would run a zero-lr step() to create it (a checkpoint must never change
    training): a lone empty placeholder entry makes it skip that, and the state is put back."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    first = next((p for g in optim.param_groups for p in g["params"]), None)
    if (with_state and optim.state) or first is None:
        return get_optimizer_state_dict(model, optim)
    kept = dict(optim.state)
    optim.state.clear()
    optim.state[first] = {}
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
