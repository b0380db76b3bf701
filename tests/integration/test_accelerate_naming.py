"""Automatic checkpoint naming across restarts (one process, real Accelerators): an attached
load_state moves ProjectConfiguration.iteration past every checkpoint_<n> folder, torn ones
included, so the next save_state works on any restart; attachment.latest() says whether there is
anything committed to resume from. Accelerate's own contract, checked first: its load_state does
not move the counter (its save_state then refuses the existing folder)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import bytecheckpoint as bcp

accelerate = pytest.importorskip("accelerate")
from accelerate.utils import ProjectConfiguration  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def restart(project: str, **config):
    """A new Accelerator over the same project directory (what a restarted process builds)."""
    acc = accelerate.Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=project, automatic_checkpoint_naming=True, **config))
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def train_step(acc, model, opt) -> None:
    acc.backward(model(torch.randn(3, 4)).pow(2).mean())
    opt.step()
    opt.zero_grad()


def tear(folder: str) -> None:
    """An async save cut short: Accelerate's own files are there, the bytecheckpoint part never committed."""
    os.remove(os.path.join(folder, "bytecheckpoint", "metadata.json"))


def names(project: str):
    return sorted(os.listdir(os.path.join(project, "checkpoints")), key=lambda n: int(n.split("_")[1]))


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def test_accelerate_alone_does_not_move_the_counter(tmp_path) -> None:
    project = str(tmp_path / "p")
    acc, model, opt = restart(project)
    acc.save_state()
    acc, model, opt = restart(project)
    acc.load_state()
    assert acc.project_configuration.iteration == 0
    with pytest.raises(ValueError, match="already exists"):
        acc.save_state()


def test_restart_continues_past_every_folder_torn_included(tmp_path) -> None:
    from accelerate_bytecheckpoint import attach

    project = str(tmp_path / "p")
    acc, model, opt = restart(project)
    handle = attach(acc)
    assert handle.latest() is None                      # first launch: nothing to resume
    for _ in range(3):
        train_step(acc, model, opt)
        acc.save_state()
    saved = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    train_step(acc, model, opt)
    acc.save_state()                                    # checkpoint_3 ...
    tear(os.path.join(project, "checkpoints", "checkpoint_3"))   # ... killed mid async save
    handle.remove()

    acc, model, opt = restart(project)                  # the restarted process
    handle = attach(acc)
    assert handle.latest() == os.path.join(project, "checkpoints", "checkpoint_2")
    acc.load_state()
    assert all(torch.equal(v, saved[k]) for k, v in acc.unwrap_model(model).state_dict().items())
    assert acc.project_configuration.iteration == 4     # past the torn checkpoint_3
    train_step(acc, model, opt)
    acc.save_state()
    assert names(project) == ["checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3", "checkpoint_4"]
    assert handle.latest() == os.path.join(project, "checkpoints", "checkpoint_4")
    handle.remove()


def test_only_torn_folders_start_fresh_and_save(tmp_path) -> None:
    from accelerate_bytecheckpoint import attach

    project = str(tmp_path / "p")
    acc, model, opt = restart(project)
    handle = attach(acc)
    acc.save_state()
    tear(os.path.join(project, "checkpoints", "checkpoint_0"))  # killed during the very first save
    handle.remove()

    acc, model, opt = restart(project)
    handle = attach(acc)
    assert handle.latest() is None                      # nothing committed: start from scratch ...
    with pytest.raises(bcp.CheckpointNotFoundError):
        acc.load_state()                                # (load_state() itself refuses the torn folder)
    assert acc.project_configuration.iteration == 1
    train_step(acc, model, opt)
    acc.save_state()                                    # ... and the first save does not collide
    assert names(project) == ["checkpoint_0", "checkpoint_1"]
    assert handle.latest() == os.path.join(project, "checkpoints", "checkpoint_1")
    handle.remove()


def test_explicit_folder_total_limit_and_a_higher_counter(tmp_path) -> None:
    from accelerate_bytecheckpoint import attach

    project = str(tmp_path / "p")
    acc, model, opt = restart(project, total_limit=2)
    handle = attach(acc)
    for _ in range(3):
        acc.save_state()
    assert names(project) == ["checkpoint_1", "checkpoint_2"]
    handle.remove()
    # load_state(<dir>) moves the counter too; a counter the user set higher is never moved back
    acc, model, opt = restart(project, total_limit=2)
    handle = attach(acc)
    acc.load_state(os.path.join(project, "checkpoints", "checkpoint_1"))
    assert acc.project_configuration.iteration == 3
    acc.project_configuration.iteration = 7
    acc.load_state()
    assert acc.project_configuration.iteration == 7
    acc.save_state()
    assert names(project) == ["checkpoint_2", "checkpoint_7"]   # total_limit pruned the oldest
    handle.remove()
    # a save after the folder counter was set back by hand still never lands on an existing folder
    handle = attach(acc)
    acc.project_configuration.iteration = 2
    acc.save_state()
    assert names(project) == ["checkpoint_7", "checkpoint_8"]
    handle.remove()


def test_latest_needs_automatic_naming(tmp_path) -> None:
    from accelerate_bytecheckpoint import attach

    acc = accelerate.Accelerator(cpu=True)
    handle = attach(acc)
    with pytest.raises(ValueError, match="automatic_checkpoint_naming=True"):
        handle.latest()
    handle.remove()
