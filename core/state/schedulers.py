"""LR schedulers: their per-group lists saved by the groups' parameter names; loaded after the
optimizers, each list rebuilt for the groups the optimizer holds now.

A scheduler keeps one entry per param group, by position (base_lrs, _last_lr, ReduceLROnPlateau's
min_lrs, CyclicLR's max_lrs and momenta, LambdaLR's lr_lambdas). Where the groups are split
otherwise at load (pipeline stages re-partitioned, the groups built in another order), a position
means another group. So each such list is saved as {"by_param_name": {name: value}} (the names of
the scheduler's optimizer's parameters, as the optimizer itself is saved: state/optimizer_form.py)
and rebuilt from the names of each group now; a group whose parameters disagree, or that the
checkpoint has no value for, is an error naming the scheduler, the list and the parameters
(base_lrs and _last_lr excepted: the loaded optimizer's groups hold them too).
SequentialLR's and ChainedScheduler's members are handled the same way. A scheduler whose optimizer
is not named by a module in the state is saved and loaded by position, as torch keeps it.
After loading, base_lrs and _last_lr also follow the loaded optimizer's groups (their
`initial_lr` and `lr` are saved per parameter name with the optimizer).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from ..common.errors import StateMismatchError
from .flatten import Handler

PER_GROUP = ("base_lrs", "_last_lr", "min_lrs", "max_lrs", "base_momentums", "max_momentums", "lr_lambdas")
BY_NAME, POSITIONS = "by_param_name", "positions"
MEMBERS = "_schedulers"


class SchedulerHandler(Handler):
    def __init__(self, optimizers: Any) -> None:
        self.optimizers = optimizers   # the OptimizerHandler: which module names an optimizer's parameters

    def group_names(self, scheduler: Any, walk) -> Optional[List[List[str]]]:
        optim = getattr(scheduler, "optimizer", None)
        model = self.optimizers.owner(optim, walk) if optim is not None else None
        if model is None:
            return None
        groups = self.optimizers.group_names(optim, model, walk)  # the names the optimizer is saved under
        ok = len(groups) == len(optim.param_groups) and all(isinstance(n, str) for g in groups for n in g)
        return groups if ok else None

    def save(self, value, key, walk):
        groups = self.group_names(value, walk)
        state = value.state_dict()
        return walk.save(by_names(state, groups) if groups is not None else state, key)

    def load(self, value, key, walk, assign):
        loaded: dict = {}
        walk.flat.subtrees[key] = lambda v: loaded.__setitem__("state", v)
        groups = self.group_names(value, walk)

        def apply() -> None:
            if "state" not in loaded:
                return
            value.load_state_dict(by_positions(loaded["state"], groups, key, value.optimizer.param_groups))
            if id(getattr(value, "optimizer", None)) in walk.optimizers:
                per_group_from_optimizer(value)
        walk.flat.after.append(apply)


def by_names(state: Dict[str, Any], groups: List[List[str]]) -> Dict[str, Any]:
    """A scheduler's state dict with its per-group lists keyed by parameter name."""
    out = dict(state)
    for k in PER_GROUP:
        v = out.get(k)
        if isinstance(v, list) and len(v) == len(groups) and any(x is not None for x in v):  # all None: nothing to keep
            # the positions too: a group without parameters has no name to be found by
            out[k] = {BY_NAME: {name: v[i] for i, names in enumerate(groups) for name in names}, POSITIONS: v}
    if isinstance(out.get(MEMBERS), list):
        out[MEMBERS] = [by_names(m, groups) if isinstance(m, dict) else m for m in out[MEMBERS]]
    return out


# lists the loaded optimizer's own groups hold too (their `initial_lr`, `lr`: saved per parameter name
# with the optimizer): where this rank's file lacks a group's names (the stages re-split at the same
# world size), they come from there
FROM_GROUPS = {"base_lrs": "initial_lr", "_last_lr": "lr"}


def by_positions(state: Dict[str, Any], groups: Optional[List[List[str]]], where: str,
                 optimizer_groups: Sequence[Dict[str, Any]] = ()) -> Dict[str, Any]:
    """The saved state with every by-name list rebuilt for the optimizer's groups now."""
    out = dict(state)
    for k, v in state.items():
        if not (isinstance(v, dict) and set(v) == {BY_NAME, POSITIONS}):
            continue
        if groups is None:
            raise StateMismatchError(f"LR scheduler {where!r}: its {k} was saved by parameter name, but this "
                                     f"scheduler's optimizer is not named by a module in the state; load it with "
                                     f"the model (and optimizer) in the same state")
        saved = v[BY_NAME]
        rebuilt = []
        for i, names in enumerate(groups):
            values = [saved[n] for n in names if n in saved]
            if not names and i < len(v[POSITIONS]):  # an empty group: by position, as torch keeps it
                values = [v[POSITIONS][i]]
            if not values and k in FROM_GROUPS and i < len(optimizer_groups) and \
                    FROM_GROUPS[k] in optimizer_groups[i]:
                values = [optimizer_groups[i][FROM_GROUPS[k]]]
            if not values:
                raise StateMismatchError(f"LR scheduler {where!r}: the checkpoint has no {k} for param group {i} "
                                         f"(parameters {names[:3]}{'...' if len(names) > 3 else ''})")
            if any(x != values[0] for x in values[1:]):
                raise StateMismatchError(f"LR scheduler {where!r}: param group {i} joins parameters saved with "
                                         f"different {k} ({sorted(set(map(repr, values)))[:4]}); build the groups as "
                                         f"they were saved")
            rebuilt.append(values[0])
        out[k] = rebuilt
    if isinstance(out.get(MEMBERS), list):
        out[MEMBERS] = [by_positions(m, groups, where, optimizer_groups) if isinstance(m, dict) else m
                        for m in out[MEMBERS]]
    return out


def per_group_from_optimizer(scheduler: Any) -> None:
    """base_lrs / _last_lr (and a SequentialLR's or ChainedScheduler's members') from the groups of
    the scheduler's optimizer, where every group has the scheduler's `initial_lr`."""
    groups = scheduler.optimizer.param_groups
    if hasattr(scheduler, "base_lrs") and all("initial_lr" in g for g in groups):
        scheduler.base_lrs = [g["initial_lr"] for g in groups]
    if hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = [g["lr"] for g in groups]
    for member in getattr(scheduler, "_schedulers", ()):
        per_group_from_optimizer(member)
