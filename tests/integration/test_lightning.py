"""ByteCheckpointIO inside a real Lightning Trainer, one process (CPU).

Multi-process (DDP) cases are in test_lightning_ddp.py, which reuses the model defined here.
"""
from __future__ import annotations

import copy
import os
import pickle
import threading
from pathlib import Path

import bytecheckpoint as bcp
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_bytecheckpoint import ByteCheckpointIO

pytestmark = pytest.mark.timeout(120)

N_SAMPLES, BATCH = 64, 8  # 8 steps per epoch on one device


class Net(pl.LightningModule):
    """Dropout + shuffled data + Adam + a step-wise LR schedule: resuming is only bit-exact if
    weights, optimizer moments, scheduler, loop position and RNG all come back."""

    def __init__(self, hidden: int = 32, extra: object = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(hidden, 1)
        )
        self.snapshots: dict[int, dict] = {}  # global_step -> what the checkpoint should hold
        self.loaded: dict | None = None  # what the checkpoint plugin handed to Lightning on resume
        self.restored: dict | None = None  # live state right after a resume (loop counters move on)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=False)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint):
        self.snapshots[self.trainer.global_step] = copy.deepcopy(_comparable(checkpoint))

    def on_load_checkpoint(self, checkpoint):
        self.loaded = copy.deepcopy(_comparable(checkpoint))

    def on_train_start(self):
        self.restored = copy.deepcopy(current_state(self.trainer))


def _comparable(checkpoint: dict) -> dict:
    """The parts of a Lightning checkpoint a resume must reproduce exactly."""
    return {
        "state_dict": {k: v.detach().cpu().clone() for k, v in checkpoint["state_dict"].items()},
        "optimizer_states": checkpoint.get("optimizer_states"),
        "lr_schedulers": checkpoint.get("lr_schedulers"),
        "global_step": checkpoint["global_step"],
        "loops": checkpoint["loops"]["fit_loop"],
    }


def current_state(trainer: pl.Trainer) -> dict:
    """The same parts (but loop counters), read from a live trainer (right after a resume)."""
    return {
        "state_dict": {k: v.detach().cpu().clone() for k, v in trainer.lightning_module.state_dict().items()},
        "optimizer_states": [opt.state_dict() for opt in trainer.optimizers],
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "global_step": trainer.global_step,
    }


def assert_resumed(model: Net, expected: dict, where: str = "resumed") -> None:
    """The plugin returned exactly the saved state, and Lightning restored it."""
    assert_same(model.loaded, expected, f"{where} (loaded)")
    assert_same(model.restored, {k: v for k, v in expected.items() if k != "loops"}, f"{where} (live)")


def assert_same(actual, expected, where="checkpoint"):
    """Exact equality through nested dicts/lists/tuples/tensors."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual)} is not a tensor"
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual.cpu(), expected.cpu()), f"{where}: values differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: {type(actual)} is not a dict"
        assert set(actual) == set(expected), f"{where}: keys {sorted(map(str, actual))} != {sorted(map(str, expected))}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{where}: {actual!r}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def dataloader(shuffle: bool = True) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, 8, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(N_SAMPLES, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=shuffle)


def make_trainer(root: Path, plugins=None, callbacks=(), **kwargs) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=str(root), max_epochs=3,
    )
    defaults.update(kwargs)
    return pl.Trainer(plugins=plugins, callbacks=list(callbacks), **defaults)


def ckpt_dirs(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


# --------------------------------------------------------------------------- resume, sync and async


_LIGHTNING_BEFORE_2_6 = tuple(int(x) for x in pl.__version__.split(".")[:2]) < (2, 6)


@pytest.mark.skipif(
    _LIGHTNING_BEFORE_2_6,
    reason="on Lightning < 2.6 the resumed run's final weights differ although the restored state is exact "
           "(assert_resumed passes on 2.4 and 2.5); cause not isolated, suspected: their loops draw the "
           "shuffle of the resumed epoch at another point than the saving run")
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_resume_is_bit_exact(tmp_path, async_save):
    """Save every epoch; resuming from epoch 0 reproduces the saving run's state at that point and
    then its final weights bit for bit (dropout and shuffling depend on the restored RNG)."""
    _resume_from_epoch_0(tmp_path, async_save, restore_rng=True)


def test_resume_without_rng_restore_diverges(tmp_path):
    """Control for the test above: it can tell whether the RNG was restored."""
    with pytest.raises(AssertionError, match="final weights"):
        _resume_from_epoch_0(tmp_path, async_save=False, restore_rng=False)


def _resume_from_epoch_0(tmp_path, async_save, restore_rng):
    ckpts = tmp_path / "ckpts"
    pl.seed_everything(1)
    model_a = Net()
    trainer_a = make_trainer(
        tmp_path, plugins=[ByteCheckpointIO(async_save=async_save)],
        callbacks=[ModelCheckpoint(dirpath=ckpts, filename="{epoch}", save_top_k=-1)],
    )
    trainer_a.fit(model_a, dataloader())
    assert ckpt_dirs(ckpts) == ["epoch=0.ckpt", "epoch=1.ckpt", "epoch=2.ckpt"]
    for name in ckpt_dirs(ckpts):
        assert (ckpts / name).is_dir() and bcp.is_checkpoint(str(ckpts / name))

    pl.seed_everything(999)  # a different init and RNG: everything must come from the checkpoint
    model_b = Net()
    trainer_b = make_trainer(tmp_path / "b", plugins=[ByteCheckpointIO(async_save=async_save, restore_rng=restore_rng)])
    trainer_b.fit(model_b, dataloader(), ckpt_path=str(ckpts / "epoch=0.ckpt"))

    assert_resumed(model_b, model_a.snapshots[8])
    assert trainer_b.global_step == trainer_a.global_step == 24
    assert_same(model_b.state_dict(), model_a.state_dict(), "final weights")
    assert_same(trainer_b.optimizers[0].state_dict(), trainer_a.optimizers[0].state_dict(), "final optimizer")


def test_checkpoint_contents_match_saving_run(tmp_path):
    """Every checkpoint of an async run holds exactly the state at its step, although training
    mutated parameters and optimizer moments right after each save (mutate-after-save race)."""
    ckpts = tmp_path / "ckpts"
    pl.seed_everything(2)
    model = Net(hidden=256)
    trainer = make_trainer(
        tmp_path, plugins=[ByteCheckpointIO(async_save=True)], max_epochs=1,
        callbacks=[ModelCheckpoint(dirpath=ckpts, filename="{step}", save_top_k=-1, every_n_train_steps=1)],
    )
    trainer.fit(model, dataloader())
    assert sorted(model.snapshots) == list(range(1, 9))
    # fit's teardown waited for the in-flight saves: all committed the moment fit returns
    assert all(bcp.is_checkpoint(str(ckpts / f"step={s}.ckpt")) for s in model.snapshots)
    for step, expected in model.snapshots.items():
        loaded = bcp.load_full(str(ckpts / f"step={step}.ckpt"))
        assert_same(_comparable(loaded), expected, f"step {step}")


def test_async_save_snapshots_before_returning(tmp_path):
    """Plugin level: mutate tensors, nested dicts and lists right after an async save returns."""
    io = ByteCheckpointIO(async_save=True)
    big = torch.randn(2048, 2048)
    state = {
        "state_dict": {"w": big, "b": torch.arange(10.0)},
        "callbacks": {"Cb": {"best_k_models": {"a/b.ckpt": torch.tensor(1.5)}, "history": [1, 2]}},
        "loops": {"epoch_loop.state_dict": {"_batches_that_stepped": 3}},
        "global_step": 3,
    }
    expected = copy.deepcopy(state)
    for _ in range(3):  # repeat: the race is timing dependent
        path = tmp_path / f"c{_}"
        io.save_checkpoint(state, path)
        big.add_(1.0)
        state["state_dict"]["b"].mul_(-1)
        state["callbacks"]["Cb"]["best_k_models"]["c.ckpt"] = torch.tensor(0.0)
        state["callbacks"]["Cb"]["history"].append(9)
        state["loops"]["epoch_loop.state_dict"]["_batches_that_stepped"] = 99
        io.teardown()
        assert_same(io.load_checkpoint(path), expected, f"save {_}")
        expected = copy.deepcopy(state)


# --------------------------------------------------------------------------- ModelCheckpoint


def test_top_k_never_deletes_in_flight_and_leaves_only_complete(tmp_path, monkeypatch):
    ckpts = tmp_path / "ckpts"
    deleted: list[tuple[str, bool]] = []
    real_delete = bcp.Checkpointer.delete

    def spy_delete(self, path, *args, **kwargs):
        deleted.append((str(path), bcp.is_checkpoint(str(path))))
        return real_delete(self, path, *args, **kwargs)

    monkeypatch.setattr(bcp.Checkpointer, "delete", spy_delete)
    pl.seed_everything(3)
    callback = ModelCheckpoint(
        dirpath=ckpts, filename="{step}", monitor="train_loss", mode="min", save_top_k=2,
        every_n_train_steps=1, save_last=True,
    )
    trainer = make_trainer(tmp_path, plugins=[ByteCheckpointIO(async_save=True)], callbacks=[callback], max_epochs=2)
    trainer.fit(Net(hidden=256), dataloader())

    kept = {os.path.basename(p) for p in callback.best_k_models} | {"last.ckpt"}
    assert set(ckpt_dirs(ckpts)) == kept and len(kept) == 3
    for name in kept:
        assert bcp.is_checkpoint(str(ckpts / name)), f"{name} is not a complete checkpoint"
    assert len(deleted) >= 3
    assert all(complete for _, complete in deleted), "a checkpoint was deleted before its save completed"
    assert not any(os.path.exists(p) for p, _ in deleted)
    scores = sorted(v.item() for v in callback.best_k_models.values())
    assert scores[-1] == callback.kth_value.item()


def test_save_last_and_resume_from_last(tmp_path):
    ckpts = tmp_path / "ckpts"
    pl.seed_everything(4)
    model = Net()
    callback = ModelCheckpoint(dirpath=ckpts, filename="{step}", every_n_train_steps=5, save_top_k=1, save_last=True)
    trainer = make_trainer(tmp_path, plugins=[ByteCheckpointIO(async_save=True)], callbacks=[callback], max_epochs=2)
    trainer.fit(model, dataloader())
    assert bcp.is_checkpoint(str(ckpts / "last.ckpt"))

    resumed = Net()
    trainer2 = make_trainer(tmp_path, plugins=[ByteCheckpointIO()], callbacks=[ModelCheckpoint(dirpath=ckpts)],
                            max_epochs=3)
    trainer2.fit(resumed, dataloader(), ckpt_path="last")
    last_step = bcp.load_full(str(ckpts / "last.ckpt"), keys=["global_step"])["global_step"]
    assert_resumed(resumed, model.snapshots[last_step], "from last")
    assert trainer2.global_step == 24


def test_save_last_link_points_at_complete_checkpoint(tmp_path):
    ckpts = tmp_path / "ckpts"
    callback = ModelCheckpoint(dirpath=ckpts, filename="{step}", every_n_train_steps=3, save_top_k=2,
                               monitor="train_loss", save_last="link")
    trainer = make_trainer(tmp_path, plugins=[ByteCheckpointIO(async_save=True)], callbacks=[callback], max_epochs=2)
    trainer.fit(Net(), dataloader())
    link = ckpts / "last.ckpt"
    assert link.is_symlink()
    target = ckpts / os.readlink(link)
    assert bcp.is_checkpoint(str(target)) and bcp.is_checkpoint(str(link))
    assert len([p for p in ckpts.iterdir() if not p.is_symlink()]) == 2  # top-k removal kept the link target
    io = ByteCheckpointIO()
    relative_target = os.readlink(link)
    io.remove_checkpoint(link)  # removing the link leaves its target alone
    assert not os.path.lexists(link) and bcp.is_checkpoint(str(target))
    os.symlink(relative_target, link)
    before = bcp.load_full(str(target), keys=["global_step"])
    io.save_checkpoint({"global_step": -1}, link)  # a full save onto the link replaces the link only
    assert not link.is_symlink() and io.load_checkpoint(link) == {"global_step": -1}
    assert bcp.load_full(str(target), keys=["global_step"]) == before


# --------------------------------------------------------------------------- formats and loading options


def test_regular_ckpt_file_still_loads(tmp_path):
    """Users switching mid-run: a TorchCheckpointIO .ckpt file resumes, new saves are directories."""
    pl.seed_everything(5)
    model = Net()
    trainer = make_trainer(tmp_path, max_epochs=1)
    trainer.fit(model, dataloader())
    legacy = tmp_path / "legacy.ckpt"
    trainer.save_checkpoint(legacy)
    assert legacy.is_file()

    ckpts = tmp_path / "ckpts"
    resumed = Net()
    trainer2 = make_trainer(tmp_path, plugins=[ByteCheckpointIO()], max_epochs=2,
                            callbacks=[ModelCheckpoint(dirpath=ckpts, filename="{epoch}")])
    trainer2.fit(resumed, dataloader(), ckpt_path=str(legacy))
    assert_same(resumed.restored["state_dict"], model.state_dict(), "legacy weights")
    assert resumed.restored["global_step"] == 8 and trainer2.global_step == 16
    assert bcp.is_checkpoint(str(ckpts / "epoch=1.ckpt"))
    io = ByteCheckpointIO()
    io.remove_checkpoint(legacy)
    assert not legacy.exists()
    trainer.save_checkpoint(legacy)  # saving onto a .ckpt file replaces it (ModelCheckpoint's last.ckpt)
    io.save_checkpoint({"global_step": 8}, legacy)
    assert bcp.is_checkpoint(str(legacy)) and io.load_checkpoint(legacy) == {"global_step": 8}


_TRAINER_WEIGHTS_ONLY = pytest.mark.skipif(
    "weights_only" not in __import__("inspect").signature(pl.Trainer.validate).parameters,
    reason="this Lightning's Trainer has no weights_only argument (added in 2.5)")


@_TRAINER_WEIGHTS_ONLY
def test_weights_only_and_pickled_hyperparameters(tmp_path):
    """weights_only maps to allow_pickle: objects that need unpickling load only with weights_only=False."""
    model = Net(extra=_Opaque(7))
    trainer = make_trainer(tmp_path, plugins=[ByteCheckpointIO()], max_epochs=1)
    trainer.fit(model, dataloader())
    path = tmp_path / "c.ckpt"
    trainer.save_checkpoint(path)

    for weights_only in (None, True):
        with pytest.raises(bcp.CheckpointError):
            make_trainer(tmp_path, plugins=[ByteCheckpointIO()]).validate(
                Net(), dataloader(False), ckpt_path=str(path), weights_only=weights_only)
    io = ByteCheckpointIO()
    loaded = io.load_checkpoint(path, weights_only=False)
    assert loaded["hyper_parameters"]["extra"] == _Opaque(7)
    evaluator = Net()
    make_trainer(tmp_path, plugins=[ByteCheckpointIO()]).validate(
        evaluator, dataloader(False), ckpt_path=str(path), weights_only=False)
    assert_same(evaluator.state_dict(), model.state_dict(), "validated weights")


@_TRAINER_WEIGHTS_ONLY
def test_weights_only_checkpoint_validates_without_pickle(tmp_path):
    ckpts = tmp_path / "ckpts"
    model = Net()
    trainer = make_trainer(tmp_path, plugins=[ByteCheckpointIO()], max_epochs=1,
                           callbacks=[ModelCheckpoint(dirpath=ckpts, filename="w", save_weights_only=True)])
    trainer.fit(model, dataloader())
    loaded = bcp.load_full(str(ckpts / "w.ckpt"))
    assert "optimizer_states" not in loaded and "state_dict" in loaded
    evaluator = Net()
    make_trainer(tmp_path, plugins=[ByteCheckpointIO()]).validate(
        evaluator, dataloader(False), ckpt_path=str(ckpts / "w.ckpt"), weights_only=True)
    assert_same(evaluator.state_dict(), model.state_dict(), "weights")


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_mixed_precision_round_trip(tmp_path, precision):
    pl.seed_everything(6)
    model = Net()
    trainer = make_trainer(tmp_path, plugins=[ByteCheckpointIO(async_save=True)], precision=precision, max_epochs=1)
    trainer.fit(model, dataloader())
    path = tmp_path / "mp.ckpt"
    trainer.save_checkpoint(path)
    trainer.strategy.checkpoint_io.teardown()
    resumed = Net()
    trainer2 = make_trainer(tmp_path, plugins=[ByteCheckpointIO()], precision=precision, max_epochs=2)
    trainer2.fit(resumed, dataloader(), ckpt_path=str(path))
    assert_resumed(resumed, model.snapshots[8])
    expected_dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert resumed.restored["state_dict"]["net.0.weight"].dtype == expected_dtype


# --------------------------------------------------------------------------- strategies and calling contracts


def test_only_sharded_strategies_are_adapted_and_survive_pickling():
    """DDP / single device need no adapter (rank 0 saves replicated state alone); the plugin only
    learns its strategy. ModelParallelStrategy bypasses the CheckpointIO, so that instance (only)
    is switched to its adapter; the switch survives pickling and is undone by another plugin."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    io = ByteCheckpointIO()
    ddp = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", plugins=[io], logger=False).strategy
    assert type(ddp) is DDPStrategy and io.strategy is ddp

    io2 = ByteCheckpointIO()
    strategy = pl.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(), plugins=[io2],
                          logger=False).strategy
    assert isinstance(strategy, ModelParallelStrategy) and type(strategy) is not ModelParallelStrategy
    assert type(strategy).__name__ == "ModelParallelStrategy" and strategy._save_distributed_checkpoint
    clone = pickle.loads(pickle.dumps(strategy))  # ddp_spawn pickles the trainer
    assert type(clone) is type(strategy) and isinstance(clone.checkpoint_io, ByteCheckpointIO)
    plain = pl.Trainer(accelerator="cpu", devices=1, logger=False).strategy
    assert type(plain) is SingleDeviceStrategy  # other strategies are untouched
    strategy.checkpoint_io = plain.checkpoint_io  # replacing the plugin undoes the adaptation
    assert type(strategy) is ModelParallelStrategy


def test_refused_strategy_fails_at_trainer_construction():
    class OwnFormat(SingleDeviceStrategy):
        pass

    from lightning_bytecheckpoint import strategies

    strategies.ADAPTERS[OwnFormat] = "it has its own format"
    try:
        with pytest.raises(TypeError, match="does not support OwnFormat: it has its own format"):
            pl.Trainer(strategy=OwnFormat(torch.device("cpu")), plugins=[ByteCheckpointIO()], logger=False)
    finally:
        del strategies.ADAPTERS[OwnFormat]
    from lightning.pytorch.strategies import DeepSpeedStrategy

    assert strategies._lookup(DeepSpeedStrategy)[0] is strategies._DeepSpeedAdapter  # accepted since issue 23


def test_sharded_state_saved_on_one_rank_fails_at_once(tmp_path):
    """A part of a tensor saved by one caller would be a checkpoint with holes: refused before
    any collective or write, naming the key."""
    io = ByteCheckpointIO()
    with pytest.raises(RuntimeError, match=r"'state_dict/w' holds only this rank's part"):
        io.save_checkpoint({"state_dict": {"w": bcp.Shard(torch.zeros(2), (4,), (0,))}}, tmp_path / "c.ckpt")
    assert not (tmp_path / "c.ckpt").exists()


class _Opaque:
    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Opaque) and other.value == self.value
