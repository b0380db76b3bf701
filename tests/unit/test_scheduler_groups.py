"""LR schedulers' per-group lists are saved by the groups' parameter names (core/state/schedulers.py):
an optimizer built with its groups in another order (as a re-partitioned pipeline stage has other
groups) gets each group's own min_lrs / max_lrs / base_lrs back, not the values of the group that
happened to sit at its position."""
import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.common.errors import StateMismatchError


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def _groups(model, reverse=False):
    groups = [{"params": list(model[0].parameters()), "lr": 0.1}, {"params": list(model[1].parameters()), "lr": 0.5}]
    return groups[::-1] if reverse else groups


def test_plateau_and_cyclic_lists_follow_the_groups_by_name(tmp_path):
    model = _model()
    opt = torch.optim.SGD(_groups(model), lr=0.1, momentum=0.9)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, min_lr=[0.01, 0.05])
    cyclic = torch.optim.lr_scheduler.CyclicLR(opt, base_lr=[0.01, 0.02], max_lr=[0.1, 0.2])
    for _ in range(3):
        opt.step()
        cyclic.step()
    bcp.save(str(tmp_path / "c"), {"model": model, "opt": opt, "plateau": plateau, "cyclic": cyclic})

    model2 = _model()
    opt2 = torch.optim.SGD(_groups(model2, reverse=True), lr=0.3, momentum=0.9)   # the groups swapped
    plateau2 = torch.optim.lr_scheduler.ReduceLROnPlateau(opt2, min_lr=[0.0, 0.0])
    cyclic2 = torch.optim.lr_scheduler.CyclicLR(opt2, base_lr=[0.0, 0.0], max_lr=[1.0, 1.0])
    bcp.load(str(tmp_path / "c"), {"model": model2, "opt": opt2, "plateau": plateau2, "cyclic": cyclic2})
    assert plateau2.min_lrs == [0.05, 0.01]              # by position it would be [0.01, 0.05]
    assert cyclic2.max_lrs == [0.2, 0.1] and cyclic2.base_lrs == [0.02, 0.01]
    assert cyclic2.last_epoch == cyclic.last_epoch
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups][::-1]


def test_a_group_joining_parameters_saved_apart_is_an_error(tmp_path):
    model = _model()
    opt = torch.optim.SGD([{"params": list(model[0].parameters())}, {"params": list(model[1].parameters())}], lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, min_lr=[0.01, 0.05])   # groups differ only here
    bcp.save(str(tmp_path / "c"), {"model": model, "opt": opt, "plateau": plateau})
    model2 = _model()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)   # one group of everything
    plateau2 = torch.optim.lr_scheduler.ReduceLROnPlateau(opt2)
    with pytest.raises(StateMismatchError, match="plateau.*param group 0 joins parameters saved with different "
                                                 "min_lrs"):
        bcp.load(str(tmp_path / "c"), {"model": model2, "opt": opt2, "plateau": plateau2}, strict=False)


def test_a_group_without_parameters_keeps_its_position(tmp_path):
    model = _model()
    opt = torch.optim.SGD([{"params": list(model.parameters())}, {"params": [], "lr": 0.7}], lr=0.1)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, min_lr=[0.01, 0.03])
    bcp.save(str(tmp_path / "c"), {"model": model, "opt": opt, "sched": sched})
    model2 = _model()
    opt2 = torch.optim.SGD([{"params": list(model2.parameters())}, {"params": [], "lr": 0.7}], lr=0.1)
    sched2 = torch.optim.lr_scheduler.ReduceLROnPlateau(opt2)
    bcp.load(str(tmp_path / "c"), {"model": model2, "opt": opt2, "sched": sched2})
    assert sched2.min_lrs == [0.01, 0.03]
