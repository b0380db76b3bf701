"""attach() in one process (a real Accelerator(cpu=True), no process group): the checkpointer it
holds, pickling, hooks that pop, a save before the first optimizer step, and the clear failure
when a private Accelerate attribute the adapter needs is gone (a future Accelerate)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch import nn

import bytecheckpoint as bcp

accelerate = pytest.importorskip("accelerate")


@pytest.fixture
def acc(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    accelerator = accelerate.Accelerator(cpu=True)
    yield accelerator
    accelerator.free_memory()


def prepared(acc, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    head = nn.Linear(2, 2)
    opt = torch.optim.AdamW(list(model.parameters()) + list(head.parameters()), lr=1e-2)
    return acc.prepare(model, head, opt)


def test_owned_checkpointer_closed_on_remove_shared_one_kept(acc) -> None:
    from accelerate_bytecheckpoint import attach

    handle = attach(acc)
    owned = handle.checkpointer
    assert isinstance(owned, bcp.Checkpointer) and not owned.closed
    handle.remove()
    assert owned.closed, "the checkpointer attach built is closed by remove()"
    shared = bcp.Checkpointer(timeout_s=7)
    handle = attach(acc, shared, async_save=True)
    assert handle.checkpointer is shared and handle.async_save and handle.pending == []
    handle.remove()
    assert not shared.closed, "a passed checkpointer is not the adapter's to close"
    shared.close()


def test_save_before_first_step_and_popping_hooks(acc, tmp_path) -> None:
    from accelerate_bytecheckpoint import attach

    model, head, opt = prepared(acc)
    seen = {}

    def save_hook(models, weights, output_dir):
        seen["save"] = (len(models), len(weights))
        torch.save(weights.pop(), os.path.join(output_dir, "head.pt"))  # the hook saves `head` itself

    def load_hook(models, input_dir):
        seen["load"] = len(models)
        models.pop().load_state_dict(torch.load(os.path.join(input_dir, "head.pt")))

    acc.register_save_state_pre_hook(save_hook)
    acc.register_load_state_pre_hook(load_hook)
    handle = attach(acc)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    acc.save_state(str(tmp_path / "ck"))  # before the first optimizer step
    assert not opt.optimizer.state, "saving filled in optimizer state"
    assert seen["save"] == (2, 2), f"user hooks must see the real models and weights: {seen}"
    names = {t.name.split("/")[0] for t in bcp.inspect(str(tmp_path / "ck" / "bytecheckpoint")).tensors}
    assert names == {"model"}, f"the popped head must not be in bytecheckpoint: {names}"
    with torch.no_grad():
        for p in list(model.parameters()) + list(head.parameters()):
            p.add_(1.0)
    acc.load_state(str(tmp_path / "ck"))
    assert seen["load"] == 2
    assert all(torch.equal(head.state_dict()[k], v) for k, v in before.items()), "head not loaded by the hook"
    assert not opt.optimizer.state, "loading a fresh optimizer's checkpoint filled in state"
    handle.remove()


def test_attached_accelerator_pickles(acc) -> None:
    from accelerate_bytecheckpoint import attach

    handle = attach(acc)
    copy = pickle.loads(pickle.dumps(acc))
    other = copy._bytecheckpoint_attachment
    assert other.checkpointer is not handle.checkpointer and not other.checkpointer.closed
    other.checkpointer.close()
    handle.remove()


@pytest.mark.parametrize("name", ["_optimizers", "_models", "_save_model_state_pre_hook"])
def test_missing_private_attribute_fails_naming_it_and_the_version(acc, name) -> None:
    from accelerate_bytecheckpoint import AccelerateCompatError, attach

    saved = acc.__dict__.pop(name)
    try:
        with pytest.raises(AccelerateCompatError, match=rf"Accelerator\.{name} .*accelerate {accelerate.__version__}"):
            attach(acc)
    finally:
        acc.__dict__[name] = saved
    attach(acc).remove()  # and works again once it is back


def test_dynamo_backend_checkpoints_load_into_plain_models_and_back(monkeypatch, tmp_path) -> None:
    """Accelerator(dynamo_backend=...) prepares an OptimizedModule; a submodule compiled by the user
    adds `_orig_mod.` inside. Both save under the module's own names (the stock model.safetensors'
    names), so a plain run resumes a compiled run's checkpoint and the other way round."""
    from accelerate_bytecheckpoint import attach

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")

    def run(dynamo: bool, seed: int):
        accelerate.state.AcceleratorState._reset_state(True)  # the dynamo setting is process-wide state
        acc = accelerate.Accelerator(cpu=True, **({"dynamo_backend": "eager"} if dynamo else {}))
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        if dynamo:
            model[0] = torch.compile(model[0], backend="eager")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        pm, po = acc.prepare(model, opt)
        assert dynamo == any("_orig_mod" in k for k in pm.state_dict())
        acc.backward(pm(torch.randn(3, 4)).sum())
        po.step()
        return acc, model, po

    def plain(sd):
        return {k.replace("_orig_mod.", ""): v for k, v in sd.items()}

    for src_dynamo in (True, False):
        acc, model, opt = run(src_dynamo, 0)
        handle = attach(acc, async_save=False)
        acc.save_state(str(tmp_path / f"ck{src_dynamo}"))
        handle.remove()
        names = {t.name for t in bcp.inspect(str(tmp_path / f"ck{src_dynamo}" / "bytecheckpoint")).tensors}
        assert "model/0.weight" in names and not any("_orig_mod" in n for n in names), sorted(names)
        acc2, model2, opt2 = run(not src_dynamo, 1)
        handle = attach(acc2)
        acc2.load_state(str(tmp_path / f"ck{src_dynamo}"))
        handle.remove()
        want, got = plain(model.state_dict()), plain(model2.state_dict())
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
        s1, s2 = opt.optimizer.state_dict()["state"], opt2.optimizer.state_dict()["state"]
        assert all(torch.equal(s1[i]["exp_avg"], s2[i]["exp_avg"]) for i in s1)
        acc2.free_memory()
