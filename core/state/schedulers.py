"""LR schedulers: saved as their state_dict; loaded after the optimizers, with their per-group lists
(base_lrs, _last_lr) taken from the loaded optimizer's groups.

A scheduler keeps one entry per param group, by position. Where ranks hold different pipeline
stages or experts, their optimizers hold other groups (a stage without the embedding has no
embedding group), so the positions of the saved list belong to the saving rank's groups only. The
groups' own `initial_lr` and `lr` (what base_lrs and _last_lr are made of) are saved per parameter
name with the optimizer (state/optimizer_form.py): after the optimizer is loaded, they are the
saved values for the parameters this rank holds now, whatever the partition.
"""
from __future__ import annotations

from typing import Any

from .flatten import Handler


class SchedulerHandler(Handler):
    def save(self, value, key, walk):
        return walk.registry.stateful.save(value, key, walk)

    def load(self, value, key, walk, assign):
        loaded: dict = {}
        walk.flat.subtrees[key] = lambda v: loaded.__setitem__("state", v)

        def apply() -> None:
            if "state" not in loaded:
                return
            value.load_state_dict(loaded["state"])
            if id(getattr(value, "optimizer", None)) in walk.optimizers:
                per_group_from_optimizer(value)
        walk.flat.after.append(apply)


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
