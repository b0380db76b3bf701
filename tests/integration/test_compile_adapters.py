"""torch.compile with the Lightning adapter (Fabric): Fabric unwraps a compiled model, so what the
plugin saves has the module's own names and loads into an uncompiled model (backend eager: the
names do not depend on the backend). Accelerate: test_accelerate_attach.py; the Trainer:
test_transformers_attach.py; the core: tests/unit/test_compile_names.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")

import bytecheckpoint as bcp  # noqa: E402


def _fabric():
    from lightning_bytecheckpoint import ByteCheckpointIO

    return L.Fabric(accelerator="cpu", devices=1, plugins=[ByteCheckpointIO(async_save=False)])


def _net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))


@pytest.mark.parametrize("how", ["before_setup", "after_setup"])
def test_fabric_compiled_model_checkpoint_loads_into_a_plain_one(tmp_path, how) -> None:
    fabric = _fabric()
    model = _net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    if how == "before_setup":
        model = torch.compile(model, backend="eager")
    pm, po = fabric.setup(model, opt)
    if how == "after_setup":
        pm = torch.compile(pm, backend="eager")
    fabric.backward(pm(torch.randn(3, 4)).sum())
    po.step()
    fabric.save(tmp_path / "ck", {"model": pm, "optimizer": po})
    names = set(bcp.Checkpointer().metadata(tmp_path / "ck").tensors)
    assert "model/0.weight" in names and not any("_orig_mod" in n for n in names), sorted(names)
    plain = _fabric()
    model2 = _net(1)
    pm2, po2 = plain.setup(model2, torch.optim.AdamW(model2.parameters(), lr=0.1))
    plain.load(tmp_path / "ck", {"model": pm2, "optimizer": po2})
    want = {k.replace("_orig_mod.", ""): v for k, v in model.state_dict().items()}
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in want.items())
