"""Lightning and Accelerate on one GPU with bytecheckpoint (skipped without CUDA): fit, async save,
resume, as a user runs them. Each case runs as its own process (a strategy may set up a process
group). Run on a lent GPU by benchmarks/gpu_session.sh."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.timeout(300)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LIGHTNING = """
import os, sys, torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy, DDPStrategy
from lightning_bytecheckpoint import ByteCheckpointIO

STRATEGY, PRECISION, ROOT = sys.argv[1], sys.argv[2], sys.argv[3]

class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

def data():
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8)

def strategy():
    return {"fsdp": lambda: FSDPStrategy(), "ddp": lambda: DDPStrategy(), "auto": lambda: "auto"}[STRATEGY]()

def trainer(steps):
    return pl.Trainer(accelerator="gpu", devices=1, strategy=strategy(), precision=PRECISION, max_steps=steps,
                      plugins=[ByteCheckpointIO(async_save=True)], logger=False, enable_progress_bar=False,
                      default_root_dir=ROOT, callbacks=[ModelCheckpoint(dirpath=ROOT, every_n_train_steps=4,
                                                                         save_top_k=-1)])

torch.manual_seed(0)
first = Net(); trainer(4).fit(first, data())
ckpt = [os.path.join(ROOT, f) for f in sorted(os.listdir(ROOT)) if "step=4" in f][0]
resumed = Net(); t = trainer(8); t.fit(resumed, data(), ckpt_path=ckpt)
assert t.global_step == 8, t.global_step
loaded = Net.load_from_checkpoint(ckpt, map_location="cpu")
if STRATEGY != "fsdp":  # the weights at step 4, as the first run left them
    for (n, p), (_, q) in zip(first.named_parameters(), loaded.named_parameters()):
        assert torch.equal(p.detach().float().cpu(), q.float()), n
assert all(torch.isfinite(p).all() for p in loaded.parameters())
print("OK", STRATEGY, PRECISION, ckpt)
"""

ACCELERATE = """
import os, sys, torch
from accelerate import Accelerator
from accelerate_bytecheckpoint import attach

ROOT = sys.argv[1]

def run(steps, save_at=None, load=None):
    acc = Accelerator(mixed_precision="bf16")
    h = attach(acc, async_save=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, 1, generator=g))
    dl = torch.utils.data.DataLoader(ds, batch_size=8)
    model, opt, dl = acc.prepare(model, opt, dl)
    start = 0
    if load:
        acc.load_state(load)
        start = save_at
    step = 0
    for epoch in range(10):
        for x, y in dl:
            if step >= start:
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            step += 1
            if save_at is not None and load is None and step == save_at:
                acc.save_state(os.path.join(ROOT, "ckpt"))
            if step == steps:
                h.wait()
                return [p.detach().float().cpu() for p in acc.unwrap_model(model).parameters()]

full = run(12)
run(6, save_at=6)
resumed = run(12, save_at=6, load=os.path.join(ROOT, "ckpt"))
for p, q in zip(full, resumed):
    assert torch.equal(p, q)
print("OK accelerate bf16")
"""


def _run(script: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


@pytest.mark.parametrize("strategy,precision", [("auto", "bf16-mixed"), ("fsdp", "32-true"), ("ddp", "16-mixed")])
def test_lightning_on_one_gpu_async_save_and_resume(tmp_path, strategy, precision):
    assert "OK" in _run(LIGHTNING, strategy, precision, str(tmp_path))


def test_accelerate_bf16_async_save_and_resume(tmp_path):
    assert "OK accelerate" in _run(ACCELERATE, str(tmp_path))
