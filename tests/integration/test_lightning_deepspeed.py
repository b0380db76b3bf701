"""Lightning's DeepSpeedStrategy (ZeRO-2 and ZeRO-3) with ByteCheckpointIO: a 2-process fit saves
through ModelCheckpoint (every rank writes its own partition; no DeepSpeed checkpoint files), and
`trainer.fit(ckpt_path=...)` on ONE process resumes it: the engine's fp32 master weights and Adam
moments equal DeepSpeed's own full view at save time, bit for bit, and the loops resume at the
saved step. DeepSpeedStrategy refuses a CPU accelerator: the test-only subclass below runs it on
CPU with gloo (issue 23's recipe).

Each run is this file executed as a script (Lightning's launcher starts rank 1 by re-running it)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # tests/: the DeepSpeed scenarios' oracle and set-up

from scenarios_deepspeed import full_view, skip_shm_build  # noqa: E402


def _cpu_deepspeed_strategy(stage: int):
    import lightning.pytorch as pl
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    class CPUDeepSpeed(DeepSpeedStrategy):
        """DeepSpeedStrategy on CPU (tests only): no CUDA check, no device-index check, and a
        device rank DeepSpeed accepts."""

        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)

        def setup_distributed(self) -> None:
            skip_shm_build()
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
            import deepspeed
            engine, opt, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self.local_rank), config=self.config, model=model,
                model_parameters=filter(lambda p: p.requires_grad, model.parameters()), optimizer=optimizer,
                lr_scheduler=lr_scheduler, dist_init_required=False)
            return engine, opt

    del pl
    return CPUDeepSpeed(stage=stage, process_group_backend="gloo",
                        config={"zero_allow_untested_optimizer": True, "train_micro_batch_size_per_gpu": 2,
                                "zero_optimization": {"stage": stage}})


def _script(argv: list[str]) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_bytecheckpoint import ByteCheckpointIO

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--load-from", default=None, help="no Trainer: Net.load_from_checkpoint(this) vs the oracle")
    p.add_argument("--stock", action="store_true", help="save with stock DeepSpeedStrategy (no plugin)")
    p.add_argument("--plain", action="store_true", help="resume on one plain CPU device (no DeepSpeed)")
    args = p.parse_args(argv)
    run = Path(args.out)
    torch.set_num_threads(1)

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(37, 53), torch.nn.LayerNorm(53), torch.nn.GELU(),
                                            torch.nn.Linear(53, 11))

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.body(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class Oracle(Callback):
        """DeepSpeed's own full view at each save (collective), and the state a resume starts from."""

        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            view = full_view(trainer.strategy.deepspeed_engine)
            if trainer.global_rank == 0:
                torch.save(view, run / f"oracle_{trainer.global_step}.pt")

        def on_train_start(self, trainer, pl_module):
            if args.resume and args.plain:  # weights and AdamW state as a plain model holds them
                opt = trainer.optimizers[0]
                view = {}
                for n, prm in pl_module.named_parameters():
                    view[f"{n}.fp32"] = prm.detach().clone()
                    for k in ("exp_avg", "exp_avg_sq"):
                        view[f"{n}.{k}"] = opt.state[prm][k].clone()
                torch.save({"step": trainer.global_step, "view": view}, run / "resumed.pt")
            elif args.resume:
                view = full_view(trainer.strategy.deepspeed_engine)
                torch.save({"step": trainer.global_step, "view": view}, run / "resumed.pt")

    if args.load_from:  # one plain process: the weights for inference, no DeepSpeed engine
        model = Net.load_from_checkpoint(args.load_from)
        oracle = torch.load(run / "oracle_3.pt", weights_only=False)
        bad = [n for n, prm in model.named_parameters() if not torch.equal(prm.detach(), oracle[f"{n}.fp32"])]
        assert not bad and oracle, f"load_from_checkpoint differs from the saved fp32 weights: {bad[:5]}"
        print("LOAD_FROM_CHECKPOINT_OK", flush=True)
        return

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 37, generator=g), torch.randn(64, 11, generator=g))
    pl.seed_everything(3 if not args.resume else 99)  # the restart's init must not matter
    strategy = "auto" if args.plain else _cpu_deepspeed_strategy(args.stage)
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy,
                         plugins=[] if args.stock else [ByteCheckpointIO()], max_steps=args.max_steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Oracle(), ModelCheckpoint(dirpath=run / "ckpts", filename="{step}",
                                                              every_n_train_steps=3, save_top_k=-1)])
    trainer.fit(Net(), DataLoader(data, batch_size=2), ckpt_path=str(run / "ckpts" / "step=3.ckpt")
                if args.resume else None)


if __name__ == "__main__":
    from _leave import leave

    _script(sys.argv[1:])
    leave(0)

# ----------------------------------------------------------------------------------- the tests

import pytest  # noqa: E402

pytest.importorskip("deepspeed")
pytest.importorskip("lightning")

from test_lightning_ddp import RUN_TIMEOUT_S, run_ddp  # noqa: E402

pytestmark = pytest.mark.timeout(3 * RUN_TIMEOUT_S + 60)


@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_deepspeed_strategy_saves_every_rank_and_resumes_on_one_process(tmp_path, stage):
    import bytecheckpoint as bcp

    run_ddp(tmp_path, "--stage", str(stage), "--max-steps", "4", script=__file__, reports=False)
    ckpt = tmp_path / "ckpts" / "step=3.ckpt"
    assert bcp.is_checkpoint(str(ckpt)), sorted(p.name for p in (tmp_path / "ckpts").iterdir())
    files = [f for d, _, fs in os.walk(ckpt) for f in fs if os.sep + "stats" not in d]  # stats/: records
    assert len(files) <= 2 * 2 + 1 and not any(f.endswith(".pt") for f in files), files  # no DeepSpeed files
    run_ddp(tmp_path, "--stage", str(stage), "--max-steps", "5", "--devices", "1", "--resume", script=__file__,
            reports=False)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    oracle = torch.load(tmp_path / "oracle_3.pt", weights_only=False)
    assert resumed["step"] == 3
    bad = [k for k, v in oracle.items() if not torch.equal(v, resumed["view"][k])]
    assert not bad, f"differ after the resume on one process: {bad[:5]}"
    if stage == 2:
        import subprocess
        import sys
        out = subprocess.run([sys.executable, __file__, "--out", str(tmp_path), "--max-steps", "0",
                              "--load-from", str(ckpt)],
                             capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=str(HERE),
                             env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
        assert "LOAD_FROM_CHECKPOINT_OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.parametrize("plain", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["deepspeed-1-process", "plain-device"])
def test_stock_deepspeed_directory_resumes_through_the_plugin_on_another_layout(tmp_path, plain):
    """Stock DeepSpeedStrategy (ZeRO-2, 2 processes, no plugin) writes DeepSpeed's own directories;
    ByteCheckpointIO resumes them on 1 process under DeepSpeed (DeepSpeed's own loader needs the
    saved world size) or on one plain device without DeepSpeed: weights, Adam moments and step."""
    run_ddp(tmp_path, "--stage", "2", "--max-steps", "4", "--stock", script=__file__, reports=False)
    ckpt = tmp_path / "ckpts" / "step=3.ckpt"
    assert (ckpt / "latest").is_file(), sorted(p.name for p in ckpt.iterdir())   # DeepSpeed's, not ours
    run_ddp(tmp_path, "--stage", "2", "--max-steps", "5", "--devices", "1", "--resume",
            *(["--plain"] if plain else []), script=__file__, reports=False)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    oracle = torch.load(tmp_path / "oracle_3.pt", weights_only=False)
    assert resumed["step"] == 3
    bad = [k for k, v in oracle.items() if not torch.equal(v, resumed["view"][k])]
    assert not bad, f"differ after the resume: {bad[:5]}"
