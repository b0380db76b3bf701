"""Lightning + ByteCheckpointIO: the train loader's position resumes step for step on another
device count (issue 32; docs/data.md). A 2-process DDP run (global batch 12 = 6 x 2, 96 samples,
2 epochs of 8 steps) saves at global steps 3 (epoch 0) and 11 (epoch 1); resumed on 1 device
(12 per device) from step 3 and on 3 processes (4 per process) from step 11, every later global
step trains the samples the uninterrupted run trained, and the 2-process run's steps are exactly
Lightning's own DistributedSampler streams (computed here): same-world runs are unchanged.
Each multi-process run is this file executed as a script (test_lightning_ddp.run_ddp)."""
from __future__ import annotations

import argparse
import collections
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

N, G, SEED = 96, 12, 7


def _script(argv):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_bytecheckpoint import ByteCheckpointIO

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--save-at", type=int, nargs="*", default=[])
    p.add_argument("--resume")
    p.add_argument("--batch", type=int, default=0, help="per device (default: the global batch 12 kept)")
    p.add_argument("--no-data-order", action="store_true", help="ByteCheckpointIO(data_order=False): stock order")
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp", "deepspeed"],
                   help="fsdp / deepspeed: on every device count, the CPU test-only subclasses of "
                        "test_lightning_fsdp.py / test_lightning_deepspeed.py")
    args = p.parse_args(argv)
    out = Path(args.out)
    torch.set_num_threads(1)
    pl.seed_everything(SEED)
    batch = args.batch or G // args.devices
    if args.strategy == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        class CPUFSDPStrategy(FSDPStrategy):  # TEST ONLY: Lightning's CPU check is `type(s) is FSDPStrategy`
            pass

        kw = {"strategy": CPUFSDPStrategy(state_dict_type="sharded", timeout=timedelta(seconds=60))}
    elif args.strategy == "deepspeed":
        from test_lightning_deepspeed import _cpu_deepspeed_strategy

        kw = {"strategy": _cpu_deepspeed_strategy(2)}
        kw["strategy"].config["train_micro_batch_size_per_gpu"] = batch
    else:
        kw = {"strategy": DDPStrategy(timeout=timedelta(seconds=60), start_method="popen")} if args.devices > 1 else {}
    trainer, model, io = fit(out, args.tag, args.devices, batch, save_at=args.save_at, resume=args.resume,
                             data_order=not args.no_data_order, fsdp=args.strategy == "fsdp",
                             # bytecheckpoint's DeepSpeed route loads Adam/AdamW state into a fresh engine, not SGD's
                             optimizer=torch.optim.AdamW if args.strategy == "deepspeed" else torch.optim.SGD, **kw)
    with open(out / f"{args.tag}_rank{trainer.global_rank}.json", "w") as f:
        json.dump({"seen": model.seen, "report": io.data_order_report}, f)


def fit(out, tag, devices, batch, *, save_at=(), resume=None, sampler=None, data_order=True, epochs=2, n=N,
        fsdp=False, optimizer=torch.optim.SGD, **kw):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_bytecheckpoint import ByteCheckpointIO

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(1, 1)
            self.seen = {}

        def configure_model(self):
            if fsdp:  # FSDP1 on CPU needs the module wrapped with device_id=cpu (test_lightning_fsdp.FSDPNet)
                from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

                if not isinstance(self.lin, FSDP):
                    self.lin = FSDP(self.lin, device_id=torch.device("cpu"), use_orig_params=True)

        def training_step(self, batch, batch_idx):
            (x,) = batch
            self.seen[int(self.trainer.global_step)] = [int(i) for i in x]
            return self.lin(x.float().unsqueeze(1)).pow(2).mean()

        def configure_optimizers(self):
            return optimizer(self.parameters(), lr=1e-3)

    class SaveAt(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step in save_at:
                trainer.save_checkpoint(Path(out) / f"{tag}_step{trainer.global_step}.ckpt")

    data = TensorDataset(torch.arange(n))
    loader = DataLoader(data, batch_size=batch, shuffle=sampler is None, sampler=sampler)
    io = ByteCheckpointIO(data_order=data_order)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, max_epochs=epochs, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                         plugins=[io], callbacks=[SaveAt()], default_root_dir=str(out), **kw)
    model = Net()
    trainer.fit(model, loader, ckpt_path=resume)
    return trainer, model, io


if __name__ == "__main__":
    from _leave import leave

    _script(sys.argv[1:])
    leave(0)

# ----------------------------------------------------------------------------------- the tests

import pytest  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

from test_lightning_ddp import RUN_TIMEOUT_S, run_ddp  # noqa: E402

pytestmark = pytest.mark.timeout(3 * RUN_TIMEOUT_S)


def _stock_steps(world):
    """Global steps of Lightning's own DistributedSampler(seed=PL_GLOBAL_SEED) streams, 2 epochs."""
    steps, b = {}, G // world
    for epoch in range(2):
        streams = []
        for r in range(world):
            s = DistributedSampler(range(N), num_replicas=world, rank=r, shuffle=True, seed=SEED)
            s.set_epoch(epoch)
            streams.append(list(s))
        for k in range(N // G):
            steps[epoch * (N // G) + k] = sorted(i for st in streams for i in st[k * b:(k + 1) * b])
    return steps


def _merged(out, tag, world):
    steps, report = collections.defaultdict(list), None
    for r in range(world):
        got = json.loads((out / f"{tag}_rank{r}.json").read_text())
        report = report or got["report"]
        for k, ids in got["seen"].items():
            steps[int(k)] += ids
    return {k: sorted(v) for k, v in steps.items()}, report


def replayed_and_skipped(ref, got, stop, epoch, per_epoch=N // G):
    """Samples of `epoch` trained twice / never when steps < stop come from ref and the rest from got."""
    c = collections.Counter(i for k in range(epoch * per_epoch, (epoch + 1) * per_epoch)
                            for i in (ref[k] if k < stop else got.get(k, [])))
    return sum(v - 1 for v in c.values() if v > 1), N - len(c)


def test_ddp_resumes_step_for_step_on_one_and_three_devices(tmp_path):
    _check_resumes(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_sharded_strategies_resume_step_for_step(tmp_path, strategy):
    """The same runs with FSDPStrategy (sharded state dict: every rank saves, the load goes in
    place) and DeepSpeedStrategy (ZeRO-2) on every device count: the record rides in the loops'
    part of the checkpoint those routes save and hand back."""
    if strategy == "deepspeed":
        pytest.importorskip("deepspeed")
    _check_resumes(tmp_path, "--strategy", strategy)


def _check_resumes(tmp_path, *flags):
    """2 processes save at steps 3 and 11; resumed on 1 from step 3 and on 3 from step 11."""
    run_ddp(tmp_path, "--tag", "ref", "--devices", "2", "--save-at", "3", "11", *flags, script=__file__,
            reports=False)
    ref, report = _merged(tmp_path, "ref", 2)
    assert ref == _stock_steps(2), "2 processes: Lightning's own DistributedSampler batches"
    assert report is None
    for world, stop in ((1, 3), (3, 11)):
        log = run_ddp(tmp_path, "--tag", f"r{world}", "--devices", str(world), "--resume",
                      str(tmp_path / f"ref_step{stop}.ckpt"), *flags, script=__file__, nprocs=world, capture=True)
        got, report = _merged(tmp_path, f"r{world}", world)
        assert sorted(got) == list(range(stop, 16)), f"2 -> {world}: resumed at step {stop}"
        assert {k: got[k] for k in got} == {k: ref[k] for k in got}, f"2 -> {world}: a later step differs"
        assert replayed_and_skipped(ref, got, stop, stop // 8) == (0, 0)
        assert report.startswith(f"data order: exact (epoch {stop // 8}, {stop % 8 * G}/96 samples consumed, 2 -> "
                                 f"{world} processes)"), report
        assert "data order: exact" in log


def test_every_strategy_passes_its_loaders_through_the_hook():
    """DDP, FSDP, DeepSpeed, ModelParallel and one device inherit Strategy.process_dataloader, the
    hook (only XLA's strategy overrides it); their samplers come from Lightning's injection."""
    from lightning.pytorch import strategies as s

    from lightning_bytecheckpoint._compat import _MARK

    for cls in (s.DDPStrategy, s.FSDPStrategy, s.DeepSpeedStrategy, s.ModelParallelStrategy, s.SingleDeviceStrategy):
        assert getattr(cls.process_dataloader, _MARK, False), cls


def test_one_device_reports(tmp_path):
    """One device, in process: the RandomSampler is replaced (DistributedSampler's order);
    data_order=False keeps it and drops a saved position; a larger global batch reports the
    samples Lightning leaves untrained; an unsupported sampler says it is not resharded."""
    import lightning.pytorch as pl

    pl.seed_everything(SEED)
    _, model, _ = fit(tmp_path, "one", 1, 12, save_at=(3,))
    assert {k: sorted(v) for k, v in model.seen.items()} == _stock_steps(1), "DistributedSampler's order"
    ckpt = str(tmp_path / "one_step3.ckpt")
    pl.seed_everything(SEED)
    _, model, io = fit(tmp_path, "off", 1, 12, resume=ckpt, data_order=False, epochs=1, save_at=(8,))
    assert io.data_order_report is None and min(model.seen) == 3  # Lightning's own mid-epoch resume (no error)
    pl.seed_everything(SEED)
    _, model, io = fit(tmp_path, "norec", 1, 12, resume=str(tmp_path / "off_step8.ckpt"))
    # an epoch-end checkpoint without a record: epoch 1 runs whole, and the line does not claim "exact"
    assert sorted(model.seen) == list(range(8, 16)), sorted(model.seen)
    assert io.data_order_report.startswith("data order: the checkpoint holds no data position (saved without "
                                           "ByteCheckpointIO's data order); resumed at the start of epoch 1"), \
        io.data_order_report
    pl.seed_everything(SEED)
    _, model, io = fit(tmp_path, "shorter", 1, 12, resume=ckpt, epochs=1, n=90)
    # another dataset length restarts the epoch's order, and Lightning's count (3 done of 8) ends it after 5 batches
    assert sorted(model.seen) == [3, 4, 5, 6, 7], sorted(model.seen)
    assert io.data_order_report.startswith("data order: not exact: the dataset has 90 samples, the checkpoint's had "
                                           "96"), io.data_order_report
    assert "30 of its 90 samples are never trained" in io.data_order_report, io.data_order_report
    pl.seed_everything(SEED)
    _, model, io = fit(tmp_path, "big", 1, 24, resume=ckpt, epochs=1)
    # Lightning's count goes on from 3 batches: 1 more batch of 24 ends epoch 0 of 4 batches; 60 - 24 = 36 untrained
    assert io.data_order_report.startswith("data order: not exact: global batch 12 -> 24"), io.data_order_report
    assert "36 of its 96 samples are never trained" in io.data_order_report
    _, model, _ = fit(tmp_path, "seq", 1, 12, sampler=torch.utils.data.SequentialSampler(range(N)), epochs=1)
    assert model.seen[0] == list(range(12)), "a SequentialSampler stays sequential"
    weights = torch.ones(N)
    _, _, io = fit(tmp_path, "weighted", 1, 12, resume=ckpt, epochs=1,
                   sampler=torch.utils.data.WeightedRandomSampler(weights, N))
    assert io.data_order_report.startswith("data order: not resharded: the sampler is a WeightedRandomSampler")
