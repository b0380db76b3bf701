"""Async staging on a real GPU (skipped without CUDA; issue 34): the optimizers' tensors copied on
a side stream behind the next forward/backward, the step's stream waiting for them, the guard on
an edit outside the step. The copies are held back by a spin kernel queued on the current stream
before save() (the side stream waits for it), so the next forward, backward and step are queued
while the copy is pending. Never run in this project's CI (no GPU); benchmarks/gpu_session.sh runs
tests/gpu on a lent one. Written without a GPU: unverified until then."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import bytecheckpoint as bcp

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.timeout(300)]
CUDA = torch.device("cuda", 0)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.BatchNorm1d(1024), nn.ReLU(), nn.Linear(1024, 512)).to(CUDA)


def _train(m, opt, x, steps=1):
    for _ in range(steps):
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _hold_current_stream(ms: float = 200.0) -> None:
    """A spin kernel on the current stream: work queued after it (and the side stream that waits on
    the current one at save()) starts only when it ends."""
    torch.cuda._sleep(int(ms * 1e-3 * torch.cuda.get_device_properties(CUDA).clock_rate * 1e3))


@pytest.mark.parametrize("kind", ["foreach", "fused"])
def test_training_goes_on_and_the_checkpoint_is_the_state_at_save(tmp_path, kind):
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, **({"fused": True} if kind == "fused" else {"foreach": True}))
    x = torch.randn(64, 512, device=CUDA)
    _train(m, opt, x)
    torch.cuda.synchronize()
    ref = copy.deepcopy({"model": {k: v.cpu() for k, v in m.state_dict().items()}})
    with bcp.Checkpointer(async_save=True) as ckpt:  # "auto": on for CUDA tensors
        _hold_current_stream()
        h = ckpt.save(tmp_path / "a", {"model": m, "optim": opt})
        assert h.stats["async_staging"] and h.stats["deferred_bytes"] > 0, dict(h.stats)
        _train(m, opt, x, steps=3)  # queued at once; each step's stream waits for the side-stream copy
        h.wait()
        got = ckpt.load_full(tmp_path / "a")
    for k, v in ref["model"].items():
        assert torch.equal(got["model"][k], v), k


def test_an_edit_outside_the_step_fails_the_save(tmp_path):
    m = _model()
    opt = torch.optim.AdamW(m.parameters())
    x = torch.randn(64, 512, device=CUDA)
    _train(m, opt, x)
    torch.cuda.synchronize()
    with bcp.Checkpointer(async_save=True) as ckpt:
        _hold_current_stream()
        h = ckpt.save(tmp_path / "a", {"model": m, "optim": opt})
        with torch.no_grad():
            m[0].weight.mul_(0.5)  # launched before the copy ran: the checkpoint could hold half of it
        with pytest.raises(bcp.CheckpointError, match="async_staging=False"):
            h.wait()
        assert not ckpt.is_checkpoint(tmp_path / "a")


def test_stall_is_launches_not_the_copy(tmp_path):
    """The stall holds no device-to-host copy of the optimizers' tensors (informational)."""
    m = _model()
    opt = torch.optim.AdamW(m.parameters())
    x = torch.randn(64, 512, device=CUDA)
    _train(m, opt, x)
    with bcp.Checkpointer(async_save=True) as ckpt:
        for i in range(3):
            _train(m, opt, x)
            h = ckpt.save(tmp_path / str(i), {"model": m, "optim": opt})
        ckpt.wait()
        assert h.stats["copies_started_early"] and h.stats["deferred_bytes"] > h.stats["copied_now_bytes"]
