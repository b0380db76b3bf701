"""ByteCheckpointIO with Lightning's FSDPStrategy (FSDP1) on 2 gloo processes, and across
strategies: FSDP(2) -> one device, one device -> FSDP(2).

Lightning refuses FSDPStrategy on CPU with a check on ``type(strategy) is FSDPStrategy``; the
TEST-ONLY subclass below runs the real strategy code on gloo, around a LightningModule that wraps
itself in FSDP1 (``device_id=cpu``) in ``configure_model``. ``test_fsdp_on_gpu`` runs the plain
strategy when CUDA is present. Runs are subprocesses with hard timeouts, like test_lightning_ddp.py.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from test_lightning import Net, assert_same, dataloader, make_trainer  # noqa: E402
from test_lightning_ddp import RUN_TIMEOUT_S, run_ddp  # noqa: E402


def _positions(osd):
    from lightning_bytecheckpoint._state import names_to_positions

    return names_to_positions(osd)


class FSDPNet(Net):
    """Net wrapped in FSDP1 by itself; records full (gathered) state on every rank."""

    def configure_model(self):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        if not isinstance(self.net, FSDP):
            self.net = FSDP(self.net, device_id=torch.device("cpu"), use_orig_params=True)

    def _full_state(self):
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        full = StateDictOptions(full_state_dict=True)
        model = self.trainer.strategy.model
        osd = get_optimizer_state_dict(model, self.trainer.optimizers[0], options=full)
        return {
            "state_dict": {k: v.detach().clone() for k, v in get_model_state_dict(model, options=full).items()},
            "optimizer": _positions(osd)["state"],
            "lr_schedulers": [c.scheduler.state_dict() for c in self.trainer.lr_scheduler_configs],
            "global_step": self.trainer.global_step,
        }

    def on_save_checkpoint(self, checkpoint):  # all ranks: gathering is collective
        self.snapshots[self.trainer.global_step] = self._full_state()

    def on_load_checkpoint(self, checkpoint):
        self.loaded = {"global_step": checkpoint["global_step"], "keys": sorted(checkpoint)}

    def on_train_start(self):
        self.restored = self._full_state()


def _script(argv: list[str]) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_bytecheckpoint import ByteCheckpointIO

    class CPUFSDPStrategy(FSDPStrategy):  # TEST ONLY: Lightning's CPU check is `type(s) is FSDPStrategy`
        def lightning_module_state_dict(self):
            # FSDP1's full state dict with offload_to_cpu=True (Lightning's choice for world > 1)
            # segfaults when the parameters already live on the CPU; the GPU case is unaffected.
            from torch.distributed.fsdp import FullStateDictConfig, StateDictType
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            if self._state_dict_type != "full":
                return super().lightning_module_state_dict()
            with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT,
                                      FullStateDictConfig(offload_to_cpu=False, rank0_only=True)):
                return {k: v.clone() for k, v in self.model.state_dict().items()}

        def optimizer_state(self, optimizer):
            # Same CPU artifact: with offload_to_cpu=True FSDP1 hands out exp_avg and exp_avg_sq as
            # views of one reused CPU buffer (.cpu() of a CPU tensor does not copy).
            from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp import OptimStateKeyType

            if self._state_dict_type != "full":
                return super().optimizer_state(optimizer)
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT,
                                      FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
                                      FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True)):
                osd = FSDP.optim_state_dict(self.model, optimizer)
                if self.global_rank == 0:
                    osd = FSDP.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_ID, self.model)
            return {**osd, "state": {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in s.items()}
                                     for k, s in osd.get("state", {}).items()}}

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--state-dict-type", default="full")
    p.add_argument("--resume")
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--stock", action="store_true", help="Lightning's own checkpointing (no plugin)")
    args = p.parse_args(argv)
    out = Path(args.out)

    torch.set_num_threads(1)
    pl.seed_everything(5)
    model = Net() if args.gpu else FSDPNet()
    strategy = (FSDPStrategy if args.gpu else CPUFSDPStrategy)(state_dict_type=args.state_dict_type)
    trainer = make_trainer(
        out, plugins=[] if args.stock else [ByteCheckpointIO(async_save=True)], devices=args.devices, max_steps=args.max_steps,
        max_epochs=-1, strategy=strategy, accelerator="gpu" if args.gpu else "cpu",
        callbacks=[ModelCheckpoint(dirpath=out / "ckpts", filename="{step}", every_n_train_steps=3, save_top_k=-1)],
    )
    trainer.fit(model, dataloader(), ckpt_path=args.resume)
    if args.gpu:
        return
    torch.save({"snapshots": model.snapshots, "loaded": model.loaded, "restored": model.restored,
                "global_step": trainer.global_step}, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    from _leave import leave

    _script(sys.argv[1:])
    leave(0)

import bytecheckpoint as bcp  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
import pytest  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_bytecheckpoint import ByteCheckpointIO  # noqa: E402

pytestmark = pytest.mark.timeout(3 * RUN_TIMEOUT_S + 60)


def _plain(snapshot):
    """A 1-device snapshot (test_lightning.Net) in FSDPNet's form."""
    return {"state_dict": snapshot["state_dict"], "optimizer": snapshot["optimizer_states"][0]["state"],
            "lr_schedulers": snapshot["lr_schedulers"], "global_step": snapshot["global_step"]}


def test_fsdp_full_resumes_across_strategies(tmp_path):
    """FSDP(2, "full") saves; one device resumes it; a 1-device checkpoint resumes on FSDP(2)."""
    ranks = run_ddp(tmp_path / "fsdp", "--max-steps", "4", script=__file__)
    ckpt = tmp_path / "fsdp" / "ckpts" / "step=3.ckpt"
    assert bcp.is_checkpoint(str(ckpt))
    saved = ranks[0]["snapshots"][3]
    assert_same(ranks[1]["snapshots"][3], saved, "FSDP ranks gather the same state")

    pl.seed_everything(123)
    one = Net()
    trainer = make_trainer(tmp_path / "one", plugins=[ByteCheckpointIO()], max_steps=6, max_epochs=-1,
                           callbacks=[ModelCheckpoint(dirpath=tmp_path / "one" / "ckpts", filename="{step}",
                                                      every_n_train_steps=6)])
    trainer.fit(one, dataloader(), ckpt_path=str(ckpt))
    assert_same(_plain(one.loaded)["state_dict"], saved["state_dict"], "FSDP(2) -> 1 device: weights")
    assert_same(_plain(one.loaded)["optimizer"], saved["optimizer"], "FSDP(2) -> 1 device: Adam moments")
    assert one.loaded["global_step"] == 3 and trainer.global_step == 6

    back = run_ddp(tmp_path / "back", "--max-steps", "7", "--resume",
                   str(tmp_path / "one" / "ckpts" / "step=6.ckpt"), script=__file__)
    expected = {k: v for k, v in _plain(one.snapshots[6]).items()}
    for rank, report in enumerate(back):
        assert_same(report["restored"], expected, f"1 device -> FSDP(2), rank {rank}")
        assert report["loaded"]["global_step"] == 6 and "state_dict" not in report["loaded"]["keys"]


def test_fsdp_sharded_needs_engine_support(tmp_path):
    """state_dict_type="sharded" gives ShardedTensor state dicts; an engine without a handler for
    them would store a rank's part as if it were the whole tensor, so the plugin refuses it
    when the strategy is built, saying what to use instead."""
    from lightning_bytecheckpoint import _state

    if _state.engine_handles_sharded_tensor():
        pytest.skip("the engine handles ShardedTensor: covered by the sharded round trip")
    from lightning.pytorch.strategies import FSDPStrategy

    class CPUFSDPStrategy(FSDPStrategy):
        pass

    with pytest.raises(TypeError, match=r"state_dict_type='sharded'.*Use state_dict_type='full'"):
        pl.Trainer(strategy=CPUFSDPStrategy(state_dict_type="sharded"), accelerator="cpu", devices=2,
                   plugins=[ByteCheckpointIO()], logger=False)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_fsdp_on_gpu(tmp_path):
    run_ddp(tmp_path, "--max-steps", "4", "--gpu", script=__file__, reports=False)
    assert bcp.is_checkpoint(str(tmp_path / "ckpts" / "step=3.ckpt"))


def test_fsdp_sharded_every_rank_writes_and_resumes_on_one_device(tmp_path):
    """state_dict_type="sharded" with the engine's FSDP1 support: every rank writes its shards
    (no gather), and one device resumes from them."""
    from lightning_bytecheckpoint import _state

    if not _state.engine_handles_sharded_tensor():
        pytest.skip("the engine has no FSDP1 (ShardedTensor) support")
    ranks = run_ddp(tmp_path / "fsdp", "--max-steps", "4", "--state-dict-type", "sharded", script=__file__)
    ckpt = tmp_path / "fsdp" / "ckpts" / "step=3.ckpt"
    info = bcp.inspect(str(ckpt))
    assert info.complete and info.world_size == 2 and all(n > 0 for n in info.info["bytes_per_rank"])
    saved = ranks[0]["snapshots"][3]
    one = Net()
    trainer = make_trainer(tmp_path / "one", plugins=[ByteCheckpointIO()], max_steps=4, max_epochs=-1)
    trainer.fit(one, dataloader(), ckpt_path=str(ckpt))
    assert_same(_plain(one.loaded)["state_dict"], saved["state_dict"], "FSDP(2, sharded) -> 1 device: weights")
    assert_same(_plain(one.loaded)["optimizer"], saved["optimizer"], "FSDP(2, sharded) -> 1 device: Adam moments")


def test_stock_fsdp_sharded_directory_resumes_on_one_device_and_on_fsdp(tmp_path):
    """Switching: a run checkpointed by stock Lightning (FSDPStrategy state_dict_type="sharded": a DCP
    directory + meta.pt, no plugin) resumes with ByteCheckpointIO on one plain device, which stock
    Lightning cannot do (IsADirectoryError), and on FSDP(2) (handed to Lightning's own loader)."""
    ranks = run_ddp(tmp_path / "stock", "--max-steps", "4", "--state-dict-type", "sharded", "--stock",
                    script=__file__)
    ckpt = tmp_path / "stock" / "ckpts" / "step=3.ckpt"
    assert (ckpt / "meta.pt").is_file() and (ckpt / ".metadata").is_file()  # Lightning's own format
    saved = ranks[0]["snapshots"][3]
    pl.seed_everything(123)
    one = Net()
    trainer = make_trainer(tmp_path / "one", plugins=[ByteCheckpointIO()], max_steps=5, max_epochs=-1)
    trainer.fit(one, dataloader(), ckpt_path=str(ckpt))
    assert_same(_plain(one.loaded)["state_dict"], saved["state_dict"], "stock FSDP(2, sharded) -> 1 device: weights")
    assert_same(_plain(one.loaded)["optimizer"], saved["optimizer"], "stock FSDP(2, sharded) -> 1 device: moments")
    assert one.loaded["global_step"] == 3 and trainer.global_step == 5
    back = run_ddp(tmp_path / "fsdp", "--max-steps", "5", "--state-dict-type", "sharded", "--resume", str(ckpt),
                   script=__file__)
    for rank, report in enumerate(back):
        assert report["loaded"]["global_step"] == 3
        assert_same(report["restored"]["state_dict"], saved["state_dict"], f"stock sharded -> FSDP(2), rank {rank}")
