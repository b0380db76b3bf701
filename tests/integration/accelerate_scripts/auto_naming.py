"""Scenario script for tests/integration/test_accelerate.py (torchrun, any process count).

Checks, asserting in-process, with an async attachment made BEFORE prepare:
  1. ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2): three save_state()
     calls, training and mutating between them, leave checkpoint_1 and checkpoint_2, each a
     committed bytecheckpoint checkpoint with no Accelerate model/optimizer files.
  2. load_state() with no argument resumes from the latest committed one (checkpoint_2) exactly,
     skipping a newer torn folder, and moves the naming counter past it.
  3. load_state(<dir without a checkpoint>) raises bytecheckpoint.CheckpointError on every rank;
     save_state twice into the same directory replaces the checkpoint.
  4. handle.remove() restores Accelerate's default: the next save writes model.safetensors and
     optimizer.bin and no bytecheckpoint/, and total_limit still prunes.
  5. A re-attached accelerator loads that legacy (default-format) checkpoint via Accelerate.
  6. end_training() right after an async save_state waits for its commit.
Prints "AUTO_NAMING_OK" on success.
"""

from __future__ import annotations

import os
import shutil
import sys

import torch
from torch import nn

import bytecheckpoint as bcp
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed

from accelerate_bytecheckpoint import CHECKPOINT_SUBDIR, attach

DEFAULT_FILES = {"model.safetensors", "pytorch_model.bin", "optimizer.bin"}


def weights(accelerator, model) -> dict:
    return {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}


def moments(opt) -> list:
    return [s["exp_avg"].clone() for s in opt.optimizer.state.values()]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def zero(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()


def node_local_dirs(accelerator, model, opt, step, project_dir: str) -> None:
    """Processes that pass different directories (per-process temp dirs, node-local disks)."""
    rank = accelerator.process_index
    accelerator.project_configuration.automatic_checkpoint_naming = False
    mine = lambda name: os.path.join(project_dir, f"{name}_{rank}")  # noqa: E731

    # a. replicated state is written by the main process only (as Accelerate writes model files):
    #    a process loading from a directory the main process did not write gets a clear error
    handle = attach(accelerator)
    accelerator.save_state(mine("own"))
    accelerator.wait_for_everyone()
    try:
        accelerator.load_state(mine("own"))
        assert accelerator.is_main_process, "a process without a checkpoint in its directory loaded one"
    except bcp.CheckpointNotFoundError as e:
        assert not accelerator.is_main_process, e
        assert f"This is process {rank}" in str(e) and "save_on_each_node=True" in str(e), e
    accelerator.wait_for_everyone()

    # b. save_on_each_node=True: each node's local main process writes its own copy; every node
    #    then resumes from its node-local directory
    accelerator.project_configuration.save_on_each_node = True
    step()
    w = weights(accelerator, model)
    accelerator.save_state(mine("node"))
    zero(model)
    accelerator.load_state(mine("node"))
    assert same(weights(accelerator, model), w), "node-local checkpoint not loaded"
    handle.remove()
    accelerator.wait_for_everyone()

    # c. a collective save refuses different directories, and node-local directories on several
    #    nodes, on every process before anything is written
    handle = attach(accelerator, collective_save=True)
    accelerator.project_configuration.save_on_each_node = False
    for directory, expected in ((mine("split"), "different directories"),
                                (os.path.join(project_dir, "shared"), "save_on_each_node=True")):
        try:
            accelerator.save_state(directory)
            raise AssertionError(f"collective save into {directory} was not refused")
        except bcp.CheckpointError as e:
            assert expected in str(e) and "Nothing was written" in str(e), e
        assert os.listdir(directory) == [], os.listdir(directory)
        accelerator.project_configuration.save_on_each_node = True
    accelerator.project_configuration.save_on_each_node = False
    handle.remove()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        print("NODE_LOCAL_OK", flush=True)


def main() -> int:
    project_dir = sys.argv[1]
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=2),
    )
    handle = attach(accelerator, async_save=True)  # before prepare: lists are read at save time
    calls = []
    accelerator.register_save_state_pre_hook(lambda models, weights_, d: calls.append(len(models)))
    set_seed(0)
    model = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    ckpts = os.path.join(project_dir, "checkpoints")

    def step() -> None:
        loss = model(torch.randn(4, 8)).pow(2).mean()
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()

    snaps = []
    for _ in range(3):
        step()
        snaps.append((weights(accelerator, model), moments(opt)))
        accelerator.save_state()  # async: returns after copy-out
        step()  # mutate while the write may still be in flight
    handle.wait()
    accelerator.wait_for_everyone()
    assert calls == [1, 1, 1], f"user hook registered after attach must see the real models: {calls}"
    names = sorted(os.listdir(ckpts))
    assert names == ["checkpoint_1", "checkpoint_2"], names
    for name in names:
        d = os.path.join(ckpts, name)
        assert bcp.is_checkpoint(os.path.join(d, CHECKPOINT_SUBDIR)), f"{d} not committed"
        assert not DEFAULT_FILES & set(os.listdir(d)), os.listdir(d)

    # 2. resume from the latest committed checkpoint: a newer folder whose bytecheckpoint part
    #    never committed (an async save cut short) is skipped
    torn = os.path.join(ckpts, "checkpoint_7")
    accelerator.wait_for_everyone()  # every rank has listed ckpts above
    if accelerator.is_main_process:
        os.makedirs(os.path.join(torn, CHECKPOINT_SUBDIR))
        open(os.path.join(torn, "random_states_0.pkl"), "wb").close()
    accelerator.wait_for_everyone()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    accelerator.load_state()
    # the naming counter moved past every folder, the torn one included (Accelerate leaves it at 3)
    assert accelerator.project_configuration.iteration == 8, accelerator.project_configuration.iteration
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(torn)
    w, m = snaps[-1]
    assert same(weights(accelerator, model), w), "weights differ from the last save"
    assert all(torch.equal(a, b) for a, b in zip(moments(opt), m)), "exp_avg differs from the last save"

    # 3. a directory that is not a checkpoint: a clear error on every rank, no hang
    empty = os.path.join(project_dir, "not_a_checkpoint")
    os.makedirs(empty, exist_ok=True)
    try:
        accelerator.load_state(empty)
    except bcp.CheckpointError as e:
        assert "no bytecheckpoint checkpoint" in str(e), e
    else:
        raise AssertionError("load_state of an empty directory did not raise")
    assert accelerator._models and accelerator._optimizers, "lists not restored after an error"
    accelerator.wait_for_everyone()

    # save_state into an existing directory replaces its checkpoint, as Accelerate does
    fixed = os.path.join(project_dir, "fixed")
    accelerator.project_configuration.automatic_checkpoint_naming = False
    for _ in range(2):
        step()
        w = weights(accelerator, model)
        accelerator.save_state(fixed)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    accelerator.load_state(fixed)
    assert same(weights(accelerator, model), w), "re-saved directory did not hold the last save"
    accelerator.project_configuration.automatic_checkpoint_naming = True

    # 4. remove() restores the default
    handle.remove()
    assert "save_state" not in vars(accelerator) and "load_state" not in vars(accelerator)
    assert len(accelerator._save_model_state_pre_hook) == 1  # only the user's
    newest = f"checkpoint_{accelerator.save_iteration}"  # save_state(fixed) counted too
    accelerator.save_state()
    accelerator.wait_for_everyone()
    names = sorted(os.listdir(ckpts))
    assert set(names) == {"checkpoint_2", newest}, names
    files = set(os.listdir(os.path.join(ckpts, newest)))
    # model.safetensors (pytorch_model.bin before accelerate 0.25 made safetensors the default)
    assert files & {"model.safetensors", "pytorch_model.bin"} and "optimizer.bin" in files, files
    assert CHECKPOINT_SUBDIR not in files, files
    legacy_w = weights(accelerator, model)

    # 5. attached again: a default-format checkpoint still loads (through Accelerate)
    handle = attach(accelerator)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    accelerator.load_state()
    assert same(weights(accelerator, model), legacy_w), "legacy checkpoint not loaded"
    handle.remove()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        print("AUTO_NAMING_OK", flush=True)

    # 7. directories of one process each (launched as 2 single-process "nodes": every process is
    #    its node's local main)
    node_local_dirs(accelerator, model, opt, step, project_dir)

    # 6. an async save still in flight at end_training: the wrapped end_training waits for the
    #    commit before destroying the process group (the test checks <project>/last is committed)
    attach(accelerator, async_save=True)
    accelerator.project_configuration.automatic_checkpoint_naming = False
    accelerator.save_state(os.path.join(project_dir, "last"))
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _leave import leave

    leave(main() or 0)
