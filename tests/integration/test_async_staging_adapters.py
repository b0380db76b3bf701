"""Async staging under the three frameworks (one process, CPU): every checkpoint a run writes with
async staging equals a synchronous save of the same state made right before it (a "shadow" save by
the same engine), while the background copies are slowed so that the next forward, backward and
optimizer step (Lightning: inside step(closure); Accelerate and the Trainer: gradient accumulation)
run while they are pending; some step waited for them (the fence). The automatic warm-up ran after
the first optimizer step, and the first save allocated (almost) nothing."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.pipeline import stage
from scenarios_async_staging import same  # noqa: E402  (tests/ is on sys.path)

pytestmark = pytest.mark.timeout(300)


def slow_copies(monkeypatch, seconds: float = 1.0) -> None:
    """Long enough that the next step comes before the copy lands, even on a loaded machine (at 0.1 s
    the Trainer once stepped after it: no step waited; at 0.4 s once too, with 3 pytest workers on 2 cores)."""
    original = stage.copy_deferred

    def slow(pairs):
        time.sleep(seconds)
        original(pairs)
    monkeypatch.setattr(stage, "copy_deferred", slow)


class Shadow:
    """Wraps ckpt.save: a synchronous save of the same state (to path + '-ref') right before each."""

    def __init__(self, monkeypatch, ckpt: bcp.Checkpointer):
        self.ckpt, self.ref = ckpt, bcp.Checkpointer(async_save=False)
        self.saves = []
        real = ckpt.save

        def save(path, state, **kw):
            keep = {k: v for k, v in kw.items() if k in ("process_group", "step")}
            self.ref.save(str(path) + "-ref", state, overwrite=True, **keep)
            handle = real(path, state, **kw)
            self.saves.append((str(path), handle))
            return handle
        monkeypatch.setattr(ckpt, "save", save)

    def check(self, min_saves: int) -> None:
        self.ckpt.wait()
        assert len(self.saves) >= min_saves, self.saves
        for path, handle in self.saves:
            assert handle.stats["async_staging"] and handle.stats["deferred_bytes"] > 0, handle.stats
            same(self.ckpt.load_full(path), self.ref.load_full(path + "-ref"), path)
        assert any(h.stats["fence_wait_s"] > 0 for _, h in self.saves), "no step ever waited for a copy"
        first = self.saves[0][1].stats
        assert first["allocated_bytes"] <= 0.05 * (first["deferred_bytes"] + first["copied_now_bytes"]), first
        self.ref.close()


# --------------------------------------------------------------------------- Lightning

@pytest.mark.parametrize("mode", ["32-true", "bf16-mixed", "manual"])
def test_lightning(tmp_path, monkeypatch, mode):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_bytecheckpoint import ByteCheckpointIO
    from lightning_bytecheckpoint import warm_up

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU(),
                                           torch.nn.Linear(256, 1))
            self.automatic_optimization = mode != "manual"

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            if self.automatic_optimization:
                return loss
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    slow_copies(monkeypatch)
    ckpt = bcp.Checkpointer(async_save=True, async_staging=True)
    shadow = Shadow(monkeypatch, ckpt)
    io = ByteCheckpointIO(ckpt)
    data = DataLoader(TensorDataset(torch.randn(96, 64), torch.randn(96, 1)), batch_size=8)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path), max_steps=8, plugins=[io],
                         precision="bf16-mixed" if mode == "bf16-mixed" else "32-true",
                         callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", filename="{step}", save_top_k=-1,
                                                    every_n_train_steps=2)])
    trainer.fit(Net(), data)
    assert warm_up.started(io) is not None and warm_up.started(io).result(30) > 0
    shadow.check(min_saves=3)
    ckpt.close()


# --------------------------------------------------------------------------- Accelerate

def test_accelerate_with_gradient_accumulation(tmp_path, monkeypatch):
    accelerate = pytest.importorskip("accelerate")
    from accelerate_bytecheckpoint import attach

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    slow_copies(monkeypatch)
    ckpt = bcp.Checkpointer(async_save=True, async_staging=True)
    shadow = Shadow(monkeypatch, ckpt)
    handle = attach(acc, checkpointer=ckpt)
    x, y = torch.randn(8, 64), torch.randn(8, 1)
    for i in range(12):
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        if i % 4 == 3:
            acc.save_state(str(tmp_path / f"s{i}"))
    assert handle.warm_up_started is not None and handle.warm_up_started.result(30) > 0
    shadow.check(min_saves=3)
    handle.remove()
    ckpt.close()
    acc.free_memory()


# --------------------------------------------------------------------------- transformers.Trainer

def test_trainer_with_gradient_accumulation(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent / "transformers_scripts"))
    from tiny import Tokens, tiny_gpt2, training_args
    from transformers import Trainer

    from transformers_bytecheckpoint import attach

    slow_copies(monkeypatch)
    ckpt = bcp.Checkpointer(async_save=True)
    shadow = Shadow(monkeypatch, ckpt)
    t = Trainer(model=tiny_gpt2(n_embd=128), args=training_args(str(tmp_path), max_steps=6, save_steps=2,
                                                      gradient_accumulation_steps=2),
                train_dataset=Tokens())
    handle = attach(t, checkpointer=ckpt, async_staging=True)
    t.train()
    assert handle.warm_up_started is not None and handle.warm_up_started.result(30) > 0
    shadow.check(min_saves=3)
    handle.remove()
    ckpt.close()
