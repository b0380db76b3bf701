"""``Fabric(plugins=[ByteCheckpointIO()])``: fabric.save / fabric.load under DDP, FSDPStrategy
(FSDP1) and ModelParallelStrategy (FSDP2 fully_shard) on 2 gloo processes, loaded on another
strategy and device count (FSDP(2) and DDP(2) -> one device in make test; ModelParallel(2) -> one device and
DDP(2) -> ModelParallel(2) in make test-frameworks-lightning).

Fabric's ModelParallelStrategy refuses any CheckpointIO on its own; the plugin adapts it so every
rank writes its shards. Fabric's DDP saves from rank 0 alone (replicated state, bcp.LOCAL).
Runs are subprocesses with hard timeouts (test_lightning_ddp.run_ddp).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from test_lightning_ddp import RUN_TIMEOUT_S, run_ddp  # noqa: E402


def _full_state(model, opt):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    from lightning_bytecheckpoint._state import names_to_positions

    full = StateDictOptions(full_state_dict=True)
    osd = names_to_positions(get_optimizer_state_dict(model, opt, options=full))
    return {"model": {k: v.detach().clone() for k, v in get_model_state_dict(model, options=full).items()},
            "optimizer": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                          for i, s in osd["state"].items()}}


def _script(argv: list[str]) -> None:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    from lightning_bytecheckpoint import ByteCheckpointIO

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", required=True, choices=["ddp", "mp", "fsdp", "single"])
    p.add_argument("--resume")
    args = p.parse_args(argv)
    out = Path(args.out)

    def fsdp2(model, mesh):
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0], mesh=mesh["data_parallel"])
        fully_shard(model, mesh=mesh["data_parallel"])
        return model

    class CPUFSDPStrategy(FSDPStrategy):  # TEST ONLY: Fabric's CPU check is `type(s) is FSDPStrategy`
        pass

    strategy = {"ddp": lambda: DDPStrategy(), "mp": lambda: ModelParallelStrategy(parallelize_fn=fsdp2),
                "fsdp": lambda: CPUFSDPStrategy(state_dict_type="sharded"),
                "single": lambda: "auto"}[args.strategy]()
    fabric = Fabric(accelerator="cpu", devices=1 if args.strategy == "single" else 2, strategy=strategy,
                    plugins=[ByteCheckpointIO(async_save=True)])
    fabric.launch()
    torch.set_num_threads(1)
    fabric.seed_everything(9)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    if args.strategy == "fsdp":  # wrapped by hand (Fabric then keeps it): FSDP1 on CPU needs device_id=cpu
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    model = fabric.setup_module(model)
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.01))
    report = {}
    if args.resume:
        state = {"model": model, "optimizer": opt, "step": 0}
        report["remainder"] = fabric.load(args.resume, state)
        report["step"] = state["step"]
        report["loaded"] = _full_state(model, opt)
    else:
        for _ in range(3):
            x = torch.randn(4, 8)
            loss = model(x).square().mean()
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
        report["saved"] = _full_state(model, opt)
        fabric.save(out / "ckpt", {"model": model, "optimizer": opt, "step": 3, "note": "hi"})
    fabric.strategy.checkpoint_io.teardown()  # Fabric has no teardown hook: wait for the async save
    fabric.barrier()
    torch.save(report, out / f"rank{fabric.global_rank}.pt")


if __name__ == "__main__":
    from _leave import leave

    _script(sys.argv[1:])
    leave(0)

import bytecheckpoint as bcp  # noqa: E402
import pytest  # noqa: E402
from test_lightning import assert_same  # noqa: E402

pytestmark = pytest.mark.timeout(4 * RUN_TIMEOUT_S + 60)


def test_fabric_fsdp1_every_rank_writes_and_loads_on_one_device(tmp_path):
    """Fabric's FSDPStrategy (FSDP1, sharded state dict; a TEST-ONLY subclass passes Fabric's GPU
    check, the model is wrapped with device_id=cpu): each rank writes its shards; one plain process
    loads model and Adam state bit-exact against FSDP's own full state dict."""
    fsdp = run_ddp(tmp_path / "fsdp", "--strategy", "fsdp", script=__file__)
    ckpt = tmp_path / "fsdp" / "ckpt"
    info = bcp.inspect(str(ckpt))
    assert info.complete and info.world_size == 2 and all(n > 0 for n in info.info["bytes_per_rank"])
    saved = fsdp[0]["saved"]
    assert_same(fsdp[1]["saved"], saved, "FSDP1 ranks gather the same state")
    [one] = run_ddp(tmp_path / "one", "--strategy", "single", "--resume", str(ckpt), script=__file__, nprocs=1)
    assert_same(one["loaded"], saved, "Fabric FSDP(2) -> one device")
    assert one["step"] == 3 and one["remainder"] == {"note": "hi"}


def test_fabric_ddp_saves_from_rank_zero_alone_and_loads_on_one_device(tmp_path):
    """Fabric's DDP calls the CheckpointIO on rank 0 only: replicated state saved by it alone."""
    ddp = run_ddp(tmp_path / "ddp", "--strategy", "ddp", script=__file__)
    ckpt = tmp_path / "ddp" / "ckpt"
    info = bcp.inspect(str(ckpt))
    assert info.complete and info.world_size == 1
    [one] = run_ddp(tmp_path / "one", "--strategy", "single", "--resume", str(ckpt), script=__file__, nprocs=1)
    assert_same(one["loaded"], ddp[0]["saved"], "Fabric DDP(2) -> one device")
    assert one["step"] == 3 and one["remainder"] == {"note": "hi"}


@pytest.mark.skipif(not os.environ.get("BCP_LIGHTNING_ALL"), reason="heavy 4-launch matrix: make test-frameworks-lightning")
def test_fabric_model_parallel_and_ddp_reshard(tmp_path):
    mp = run_ddp(tmp_path / "mp", "--strategy", "mp", script=__file__)
    ckpt = tmp_path / "mp" / "ckpt"
    info = bcp.inspect(str(ckpt))
    assert info.complete and info.world_size == 2 and all(n > 0 for n in info.info["bytes_per_rank"])
    assert {t.name: t.layout for t in info.tensors}["model/0.weight"] == "sharded"
    saved = mp[0]["saved"]
    assert_same(mp[1]["saved"], saved, "FSDP2 ranks gather the same state")

    [one] = run_ddp(tmp_path / "one", "--strategy", "single", "--resume", str(ckpt), script=__file__, nprocs=1)
    assert_same(one["loaded"], saved, "ModelParallel(2) -> one device")
    assert one["step"] == 3 and one["remainder"] == {"note": "hi"}

    ddp = run_ddp(tmp_path / "ddp", "--strategy", "ddp", script=__file__)
    info = bcp.inspect(str(tmp_path / "ddp" / "ckpt"))
    assert info.complete and info.world_size == 1  # replicated: rank 0 alone
    back = run_ddp(tmp_path / "back", "--strategy", "mp", "--resume", str(tmp_path / "ddp" / "ckpt"),
                   script=__file__)
    for rank, report in enumerate(back):
        assert_same(report["loaded"], ddp[0]["saved"], f"DDP(2) -> ModelParallel(2), rank {rank}")
        assert report["step"] == 3 and report["remainder"] == {"note": "hi"}
