"""Leaving bytecheckpoint: `bytecheckpoint convert` writes our checkpoints as PyTorch DCP (dcp.load
resumes model, Adam moments and step) and as a Lightning .ckpt file (stock Lightning resumes it,
no plugin). torchtitan's own manager resuming a converted checkpoint: tests/torchtitan."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import bytecheckpoint as bcp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _convert(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "bytecheckpoint", "convert", *args], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2))


def test_ours_to_dcp_is_resumed_by_dcp_load(tmp_path):
    torch.manual_seed(0)
    model = _model()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    optim = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=2e-3)
    for _ in range(2):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    bcp.save(str(tmp_path / "ours"), {"model": model, "optim": optim, "step": 2, "note": {"run": "a"}})
    printed = _convert(str(tmp_path / "ours"), str(tmp_path / "dcp"), "--to", "dcp")
    assert "(bytecheckpoint) to" in printed and (tmp_path / "dcp" / ".metadata").is_file()

    torch.manual_seed(1)
    fresh = _model()
    fdecay = [p for n, p in fresh.named_parameters() if n.endswith("weight")]
    frest = [p for n, p in fresh.named_parameters() if not n.endswith("weight")]
    fopt = torch.optim.AdamW([{"params": fdecay}, {"params": frest, "weight_decay": 0.0}], lr=1.0)
    fresh(torch.randn(1, 8)).sum().backward()
    fopt.step()  # DCP's optimizer loading needs the state to exist (its own resume does the same)
    fopt.zero_grad()
    msd, osd = get_state_dict(fresh, fopt)
    sd = {"model": msd, "optim": osd, "step": 0, "note": {"run": ""}}
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"))
    set_state_dict(fresh, fopt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert sd["step"] == 2 and sd["note"] == {"run": "a"}
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k
    for p1, p2 in zip(model.parameters(), fresh.parameters()):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optim.state[p1][k], fopt.state[p2][k]), k
    assert [g["lr"] for g in fopt.param_groups] == [2e-3, 2e-3] and fopt.param_groups[1]["weight_decay"] == 0.0
    # and back: the converted directory loads through bcp too
    again = _model()
    bcp.load(str(tmp_path / "dcp"), {"model": again}, strict=False)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_convert_refuses_to_overwrite_and_bad_targets(tmp_path):
    bcp.save(str(tmp_path / "ours"), {"w": torch.ones(2)})
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep")
    out = subprocess.run([sys.executable, "-m", "bytecheckpoint", "convert", str(tmp_path / "ours"),
                          str(tmp_path / "taken"), "--to", "dcp"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "exists" in out.stderr and (tmp_path / "taken" / "x").read_text() == "keep"


def test_ours_to_lightning_ckpt_resumes_in_stock_lightning(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from test_lightning import Net, assert_same, dataloader, make_trainer

    from lightning_bytecheckpoint import ByteCheckpointIO

    model = Net()
    trainer = make_trainer(tmp_path / "ours", plugins=[ByteCheckpointIO()], max_steps=4, max_epochs=-1,
                           callbacks=[ModelCheckpoint(dirpath=tmp_path / "ours" / "ckpts", filename="{step}",
                                                      every_n_train_steps=4)])
    trainer.fit(model, dataloader())
    saved = tmp_path / "ours" / "ckpts" / "step=4.ckpt"
    assert bcp.is_checkpoint(str(saved))
    _convert(str(saved), str(tmp_path / "stock.ckpt"), "--to", "torch", "--layout", "lightning")
    stock = Net()
    make_trainer(tmp_path / "stock", max_steps=6, max_epochs=-1).fit(stock, dataloader(),
                                                                     ckpt_path=str(tmp_path / "stock.ckpt"))
    # weights, Adam moments, scheduler, step exactly; the plugin's data position is dropped (stock loaders keep none)
    expected = {k: v for k, v in model.snapshots[4].items() if k != "loops"}
    assert_same({k: v for k, v in stock.loaded.items() if k != "loops"}, expected, "ours -> .ckpt -> stock Lightning")
    assert_same(stock.restored, expected, "stock Lightning's live state after the resume")
    assert stock.loaded["loops"]["state_dict"]["combined_loader"] == []


@pytest.mark.timeout(300)
def test_convert_under_torchrun_writes_every_rank_share(tmp_path):
    """`torchrun --nproc_per_node 2 -m bytecheckpoint convert`: each process writes its share of the
    tensors (files __0_* and __1_*), the coordinator the one .metadata; dcp.load reads it whole."""
    src, dst = str(tmp_path / "ours"), str(tmp_path / "dcp")
    state = {"w": {f"layer{i}": torch.randn(600, 600) for i in range(12)}, "step": 5}  # > 1 batch per rank
    bcp.save(src, state)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "bytecheckpoint", "convert", src, dst, "--to", "dcp"], capture_output=True, text=True,
                         timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    files = sorted(os.listdir(dst))
    assert any(f.startswith("__0_") for f in files) and any(f.startswith("__1_") for f in files), files
    assert out.stdout.count("converted") == 1, out.stdout  # the coordinator reports
    back = {"w": {k: torch.zeros(600, 600) for k in state["w"]}, "step": 0}
    dcp.load(back, checkpoint_id=dst)
    assert back["step"] == 5 and all(torch.equal(back["w"][k], v) for k, v in state["w"].items())
